"""Message keys, digests and provenance: what "the same turn" means, and where a token came from.

Scaffolds re-serialize the history they send back (tool-call ids renamed, reasoning dropped,
arguments re-encoded, whitespace changed); a key keeps only what must be equal for two messages to
be one turn. Digests chain keys and ids so that equal requests are found without comparing them.
"""

from __future__ import annotations

import functools
import json
import zlib
from enum import IntEnum
from typing import Any, Protocol

import orjson

from rewriter.canonical import Message, ToolSpec


class Provenance(IntEnum):
    PROMPT = 0  # rendered by the chat template (scaffold or environment text): never trained
    SAMPLED = 1  # sampled by the policy in exactly this context; logprob from the sampler
    RECOMPUTED = (
        2  # sampled by the policy, context since changed; logprob re-scored (prompt_logprobs)
    )
    STALE = 3  # as RECOMPUTED but the recompute is switched off: masked out of the loss


TRAINED = (Provenance.SAMPLED, Provenance.RECOMPUTED)

MessageKey = tuple[Any, ...]


class Renderer(Protocol):
    def render_text(
        self,
        messages: list[Message],
        tools: list[ToolSpec] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    @property
    def assistant_tail(self) -> Any: ...


@functools.lru_cache(maxsize=65536)
def _canonical_args(arguments: str) -> str:
    # Cached: every call re-sends the whole history, and its arguments texts repeat verbatim.
    try:
        value = json.loads(arguments, strict=False)
    except (json.JSONDecodeError, TypeError):
        return arguments.strip()
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def message_key(message: Message) -> MessageKey:
    """What must be equal for two messages to be "the same" turn.

    Ignored on purpose, because scaffolds change them between calls without changing meaning:
    tool-call ids, reasoning (templates and clients drop it), JSON spacing and key order of
    tool-call arguments, whitespace in assistant text (Anthropic clients send text around a
    tool call back as separate blocks, which arrive joined by other whitespace).
    """
    # Called for every message of every call: kept lean (no generator for the usual one call).
    if message.role != "assistant":
        return (message.role, message.content)
    calls = message.tool_calls
    if len(calls) == 1:
        call = calls[0]
        return (
            "assistant",
            _canonical_text(message.content),
            ((call.name, _canonical_args(call.arguments)),),
        )
    keys = tuple([(c.name, _canonical_args(c.arguments)) for c in calls])
    return ("assistant", _canonical_text(message.content), keys)


def _canonical_text(text: str) -> str:
    # Most replies that carry a tool call have no text at all: skip the split for them.
    return " ".join(text.split()) if text else text


def _schema_key(parameters: dict[str, Any]) -> bytes | str:
    try:
        # Every call resends its tools (an agent's: tens of kB of schemas); orjson writes them
        # five times as fast as json.dumps, as exactly (1, 1.0 and true stay apart).
        return orjson.dumps(parameters, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(parameters, sort_keys=True)


def header_key(tools: list[ToolSpec], enable_thinking: bool | None) -> MessageKey:
    return (
        tuple((t.name, t.description, _schema_key(t.parameters)) for t in tools),
        enable_thinking,
    )


def fold_keys(digest: int, keys: list[MessageKey]) -> int:
    for key in keys:
        digest = zlib.crc32(repr(key).encode("utf-8", "surrogatepass"), digest)
    return digest


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: long identical prefixes are the common case.
    step = 1024
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i
