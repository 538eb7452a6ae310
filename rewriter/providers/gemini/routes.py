"""Gemini routes: the model and the method are in the URL (``/v1beta/models/M:generateContent``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

API_VERSIONS = ("v1beta", "v1", "v1alpha")
GENERATION_METHODS = ["generateContent", "streamGenerateContent", "countTokens"]
# Gemini joins the text parts of one turn as they are: a streamed reply comes back to the server
# as many text parts whose concatenation is the reply.
PART_SEPARATOR = ""

# -- routes ----------------------------------------------------------------------------------

RouteKind = Literal["generate", "stream", "count_tokens", "list_models", "get_model", "other"]

_ROUTE_RE = re.compile(r"^/(v1beta|v1|v1alpha)/models(?:/([^/:]+))?(?::([A-Za-z]+))?/?$")
_KINDS: dict[str, RouteKind] = {
    "generateContent": "generate",
    "streamGenerateContent": "stream",
    "countTokens": "count_tokens",
}


@dataclass(frozen=True)
class Route:
    """What a Gemini API path asks for. ``method`` is the text after ``:`` (``other`` kinds:
    ``embedContent``, ``batchGenerateContent``, ... which this proxy does not serve)."""

    kind: RouteKind
    api_version: str
    model: str = ""
    method: str = ""


def parse_route(http_method: str, path: str) -> Route | None:
    """The Gemini route of ``path`` (already percent-decoded), or None if it is not one."""
    match = _ROUTE_RE.match(path)
    if match is None:
        return None
    version, model, method = match.group(1), match.group(2) or "", match.group(3) or ""
    if not model:
        if method:
            return None
        return Route("list_models" if http_method == "GET" else "other", version)
    if not method:
        return Route("get_model" if http_method == "GET" else "other", version, model)
    kind = _KINDS.get(method, "other") if http_method == "POST" else "other"
    return Route(kind, version, model, method)
