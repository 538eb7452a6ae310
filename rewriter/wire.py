"""What every provider's wire format shares: the lenient request model base and SSE framing.

Each provider's own modules keep what differs (field names, error shapes, event names); the
framing of a server-sent event and the rule that unknown request fields are accepted live here
once.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
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


class TextEvent:
    """An event whose one varying part is a string (a streamed text delta): rendered once
    around a marker, then each text is JSON-encoded into the gap, byte for byte what rendering
    the whole event gives, for a third of the cost per token."""

    def __init__(self, render: Callable[[str], bytes]) -> None:
        # A marker no client can write into the rest of the event (a model name is the
        # client's): a fixed one, sent back as a model name, made this raise mid-stream.
        marker = f"\u0000agenttap text {secrets.token_hex(8)}\u0000"
        mark = json.dumps(marker, ensure_ascii=False).encode()
        head, found, tail = render(marker).partition(mark)
        if not found or mark in tail:
            raise ValueError("the event must hold its text exactly once")
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail
