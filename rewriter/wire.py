"""What every provider's wire format shares: the lenient request model base and SSE framing.

Each provider's own modules keep what differs (field names, error shapes, event names); the
framing of a server-sent event and the rule that unknown request fields are accepted live here
once.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict


class Lenient(BaseModel):
    """A request model that accepts fields it does not declare: clients send many the policy
    has no use for (metadata, store, user, service_tier, ...), and refusing them would break
    real clients."""

    model_config = ConfigDict(extra="allow")


def sse(
    obj: dict[str, Any],
    event: str | None = None,
    *,
    compact: bool = False,
    terminator: bytes = b"\n\n",
) -> bytes:
    """One server-sent event: an optional ``event:`` line (Anthropic, Responses), then the JSON
    ``data:`` line. ``compact`` drops JSON's spaces (Anthropic's servers send it so);
    ``terminator`` ends the event (Google's servers use CRLF)."""
    separators = (",", ":") if compact else None
    data = json.dumps(obj, ensure_ascii=False, separators=separators).encode()
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + data + terminator
