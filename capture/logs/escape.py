"""Agent-chosen text made safe for one log line.

A file name, a proxy username or an error string an agent wrote may hold a newline (a forged
``agenttap: ...`` line after it), a terminal escape (``\\x1b[2J`` clears the reader's screen), a
unicode line separator or a bidi override (the line reads otherwise than it is). ``printable``
writes every such character as its Python escape (``\\n``, ``\\x1b``, ``\\u2028``), the rest as
it is: what the log shows is one line, in the order it was written.

Pure: used by whatever logs a string it did not choose itself.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped: C0 and C1 controls, DEL,
    U+2028/U+2029, bidi and other format characters (U+202E, U+2066..., zero-width ones), lone
    surrogates (an undecodable file name's bytes), spaces other than the plain one. Printable
    text (any script) is kept as it is."""
    if text.isprintable():
        return text  # the common case, without a copy
    return "".join(c if c.isprintable() else _escape(c) for c in text)
