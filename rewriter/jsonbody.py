"""The one JSON reader for request bodies and WebSocket messages, shared by every provider.

Python's ``json`` accepts more than JSON, and what it lets through breaks things later, far from
the request: ``NaN`` / ``Infinity`` literals and numbers past a float's range (``1e999``) become
``nan`` / ``inf`` (an ``OverflowError`` where a field is converted to an integer, ``NaN`` sent to
the policy as a temperature, ``Infinity`` written into a journal that is then not JSON); integers
of any size (past what any API field or the policy takes, slow to convert past a few thousand
digits); lone UTF-16 surrogates (text that cannot be written as UTF-8); nesting deep enough to
exhaust the stack of whatever walks it next. :func:`loads` refuses all of them when the body is
read, with a message that names the bad value, so each provider can word it as its own 400.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# Deeper than any real request nests (tool schemas take a few levels); recursive code that walks
# a request later (validation, the chat template, the journal) stays far from the stack's limit.
MAX_DEPTH = 100
# Integers are read as 64-bit signed: every integer field of these APIs (and of vLLM) is one.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1

# A \uD800-\uDFFF escape: only then can a string hold a lone surrogate (raw UTF-8 cannot).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JSONBodyError(ValueError):
    """A body that is not JSON this proxy reads; the message says what and where."""


def _constant(name: str) -> Any:
    raise JSONBodyError(f"{name} is not a JSON value: numbers must be finite")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONBodyError(
            f"the number {_short(text)} is out of range: numbers must be finite "
            "(at most about 1.8e308 in size)"
        )
    return value


def _int(text: str) -> int:
    # Length first: converting thousands of digits is slow, and Python refuses past 4300.
    digits = len(text.lstrip("-"))
    value = int(text) if digits <= 19 else None
    if value is None or not INT_MIN <= value <= INT_MAX:
        raise JSONBodyError(
            f"the integer {_short(text)} is out of range: integers must lie between "
            f"{INT_MIN} and {INT_MAX}"
        )
    return value


def _short(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} digits)"


_DECODER = json.JSONDecoder(parse_float=_float, parse_int=_int, parse_constant=_constant)


def loads(data: bytes | str) -> Any:
    """``data`` (UTF-8 bytes, or text) as a JSON value, or :class:`JSONBodyError`."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = data[exc.start : exc.start + 1]
            raise JSONBodyError(f"it is not UTF-8 text (byte {exc.start} is {bad!r})") from None
    else:
        text = data
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark, as json.loads of bytes allows
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise JSONBodyError(str(exc)) from None
    except RecursionError:
        raise JSONBodyError(f"it nests deeper than {MAX_DEPTH} levels") from None
    _check(value, text)
    return value


def _check(value: Any, text: str) -> None:
    """Depth (the containers walked) and lone surrogates (every string, only where the text
    has a surrogate escape)."""
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if not surrogates:
        # Only the containers are walked (a long prompt is one string): cheaper than counting
        # the text's brackets. The recursion stops at MAX_DEPTH, far from the stack's limit.
        if isinstance(value, dict | list):
            _check_depth(value, 0)
        return
    # Iterative: the walk itself must not be what a deep body breaks.
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if surrogates:
                _check_text(node)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            raise JSONBodyError(f"it nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            for key, item in node.items():
                if surrogates:
                    _check_text(key)
                stack.append((item, depth + 1))
        else:
            stack.extend((item, depth + 1) for item in node)


def _check_depth(node: Any, depth: int) -> None:
    if depth >= MAX_DEPTH:
        raise JSONBodyError(f"it nests deeper than {MAX_DEPTH} levels")
    for item in node.values() if type(node) is dict else node:
        kind = type(item)
        if kind is dict or kind is list:
            _check_depth(item, depth + 1)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise JSONBodyError(
            f"a string holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x} without its "
            "pair), which is not text"
        ) from None
