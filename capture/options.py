"""Validation of agenttap's numeric mitmproxy options and of misspelled ``agenttap_*`` names.

The numeric options are declared as strings: mitmproxy converts ``--set name=value`` for an
``int`` option while it loads the script, and a value such as ``abc`` or ``8MB`` then fails
inside mitmproxy's loader, which skips the addon and leaves a plain forwarding proxy running.
As strings they always reach our ``configure``, which rejects them with a message naming the
option and what to give instead."""

from __future__ import annotations

from collections.abc import Iterable

PREFIX = "agenttap_"


class OptionValueError(ValueError):
    """An agenttap option has a value the proxy cannot run with."""


def non_negative_int(name: str, value: str, *, minimum: int = 0, example: int = 300) -> int:
    """``value`` as a whole number >= ``minimum``, or an error that says how to fix it."""
    text = str(value).strip()
    try:
        number = int(text, 10)
    except ValueError:
        raise OptionValueError(
            f"{name}={value!r} is not a whole number; give digits only "
            f"(for example --set {name}={example}, no units or decimals)"
        ) from None
    if number < minimum:
        raise OptionValueError(f"{name}={value!r} must be at least {minimum}")
    return number


def unknown_agenttap_names(given: Iterable[str], known: Iterable[str]) -> list[str]:
    """Names in ``given`` that look like agenttap options but are not ones it declares."""
    known_set = set(known)
    return sorted(n for n in given if n.startswith(PREFIX) and n not in known_set)


def unknown_names_message(unknown: list[str], known: Iterable[str]) -> str:
    import difflib

    known_list = sorted(known)
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known_list, n=1)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return (
        f"agenttap: unknown option(s) {', '.join(hints)}; "
        f"agenttap's options are {', '.join(known_list)}"
    )
