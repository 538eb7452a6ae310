"""Shape checks for the parts of a request body that translation walks by hand.

The wire schemas (pydantic) type the top of each request; below that, content blocks, tool
schemas and format objects are read as plain JSON values. Each read goes through one of these, so
a value of the wrong type is the client's 400 naming where it is (``tools.0.input_schema``), and
anything else a translation raises is a defect of ours: a 500 with its traceback in the log.
"""

from __future__ import annotations

from typing import Any

from rewriter.canonical import RequestError


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


def expect_object(value: Any, where: str) -> dict[str, Any]:
    """``value`` when it is a JSON object; else the client's error at ``where``."""
    if not isinstance(value, dict):
        raise RequestError(f"{where}: expected an object, got {_kind(value)}.", param=where)
    return value


def expect_list(value: Any, where: str) -> list[Any]:
    """``value`` when it is a JSON array; else the client's error at ``where``."""
    if not isinstance(value, list):
        raise RequestError(f"{where}: expected an array, got {_kind(value)}.", param=where)
    return value


def text_or_none(value: Any) -> str | None:
    """``value`` when it is a string (a ``type`` or ``name`` field compared with known ones)."""
    return value if isinstance(value, str) else None
