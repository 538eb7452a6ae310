"""Reading a Gemini request's fields: protobuf JSON names in either case, objects and lists
checked where they are read, numbers and int64 strings within range."""

from __future__ import annotations

import re
from typing import Any

from rewriter import jsonbody
from rewriter.canonical import (
    RequestError,
)

# -- request ---------------------------------------------------------------------------------


def snake_case(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def get_field(obj: dict[str, Any], name: str) -> Any:
    """A field by its JSON (lowerCamel) name or its proto (snake_case) name: Google's JSON
    parser accepts both, and clients use both."""
    if name in obj:
        return obj[name]
    return obj.get(snake_case(name))


def object_at(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(
            f"Invalid JSON payload received. {where}: expected an object, got "
            f"{type(value).__name__}.",
            param=where,
        )
    return value


def list_at(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(
            f"Invalid JSON payload received. {where}: expected a list, got {type(value).__name__}.",
            param=where,
        )
    return value


def number_at(
    config: dict[str, Any], name: str, *, low: float | None = None, high: float | None = None
) -> float | None:
    value = get_field(config, name)
    if value is None:
        return None
    where = f"generation_config.{snake_case(name)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{where}: expected a number, got {value!r:.60}.", param=where)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"{where}: {value} is out of range {bounds}.", param=where)
    return float(value)


def integer_at(config: dict[str, Any], name: str, *, low: int) -> int | None:
    value = get_field(config, name)
    if value is None:
        return None
    where = f"generation_config.{snake_case(name)}"
    if isinstance(value, bool) or not isinstance(value, int):
        # Proto JSON allows int64 as a string (ASCII digits only; int() takes others too).
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,19}", value):
            value = int(value)
        else:
            raise RequestError(f"{where}: expected an integer, got {value!r:.60}.", param=where)
    if not jsonbody.INT_MIN <= value <= jsonbody.INT_MAX:
        raise RequestError(f"{where}: {value} is out of the int64 range.", param=where)
    if value < low:
        raise RequestError(f"{where}: must be at least {low} (got {value}).", param=where)
    return int(value)
