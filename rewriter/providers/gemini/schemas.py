"""Gemini's OpenAPI-subset schemas (``parameters``, ``responseSchema``) as JSON Schema."""

from __future__ import annotations

from typing import Any

from rewriter.canonical import (
    RequestError,
)
from rewriter.providers.gemini.fields import get_field, list_at, object_at

_SCHEMA_KEYWORDS = (
    "format",
    "title",
    "description",
    "enum",
    "default",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
)
_INT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def openapi_to_json_schema(schema: Any, where: str = "schema") -> dict[str, Any]:
    """Gemini's ``Schema`` (OpenAPI 3.0 subset, upper-case ``type``, ``nullable``,
    ``propertyOrdering``) as the JSON Schema vLLM's structured outputs and chat templates take.
    Lower-case types (clients often send them) are accepted as well."""
    node = object_at(schema, where)
    out: dict[str, Any] = {}
    kind = node.get("type")
    if isinstance(kind, str) and kind.upper() != "TYPE_UNSPECIFIED":
        out["type"] = kind.lower()
    elif kind is not None and not isinstance(kind, str):
        raise RequestError(f"{where}.type: expected a type name, got {kind!r}.", param=where)
    for key in _SCHEMA_KEYWORDS:
        value = get_field(node, key)
        if value is None:
            continue
        if key in _INT_KEYWORDS and isinstance(value, str) and value.isdigit():
            value = int(value)  # int64 fields arrive as strings in proto JSON
        out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    properties = node.get("properties")
    if properties is not None:
        out["properties"] = {
            name: openapi_to_json_schema(sub, f"{where}.properties.{name}")
            for name, sub in object_at(properties, f"{where}.properties").items()
        }
    if node.get("items") is not None:
        out["items"] = openapi_to_json_schema(node["items"], f"{where}.items")
    any_of = get_field(node, "anyOf")
    if any_of is not None:
        out["anyOf"] = [
            openapi_to_json_schema(sub, f"{where}.any_of[{k}]")
            for k, sub in enumerate(list_at(any_of, f"{where}.any_of"))
        ]
    if node.get("nullable") is True:
        if "type" in out:
            out["type"] = [out["type"], "null"]
        elif "anyOf" in out:
            out["anyOf"].append({"type": "null"})
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


_GEMINI_TYPES = frozenset(("STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"))


def lower_case_types(schema: Any) -> Any:
    """A JSON schema with Gemini's upper-case type names (``"OBJECT"``) lower-cased.

    Gemini accepts them in ``responseJsonSchema`` and ``parametersJsonSchema``, and Gemini CLI's
    router sends them there; JSON Schema (and so vLLM's structured outputs) knows only the
    lower-case names. Anything else is left exactly as it is."""
    if isinstance(schema, list):
        return [lower_case_types(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str) and value in _GEMINI_TYPES:
            out[key] = value.lower()
        elif key == "type" and isinstance(value, list):
            out[key] = [v.lower() if v in _GEMINI_TYPES else v for v in value]
        else:
            out[key] = lower_case_types(value)
    return out
