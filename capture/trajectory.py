"""Token-exact trajectories: which thread a call extends, and the exact ids it is prompted with.

Pure core: plain dataclasses and functions over token ids and canonical messages; no HTTP, no
mitmproxy, no vLLM. The one outside dependency is a renderer (``rewriter.template.ChatTemplate``).

A *thread* is one conversation inside a session: a token sequence (``ids``) with, per token, a
logprob and a provenance (prompt / sampled / recomputed / stale), plus the keys of the messages
it represents. When a scaffold sends its next call, its history holds the assistant messages we
returned, re-serialized by the scaffold (reasoning dropped, tool-call arguments re-encoded, ids
renamed). Matching is done on normalized message keys, and the prompt is built from the thread's
exact ids: the policy's sampled tokens are never re-rendered from text.

* Extension (the common case): the call's messages extend a thread's messages. Prompt = thread
  ids + the template's closing tokens after the last reply + only the new messages rendered.
  Cost: proportional to the new messages.
* Rewrite: the call shares a prefix holding at least one policy reply with a thread but then
  differs (a ``<system-reminder>`` injected into an old turn, an edited tool result). The whole
  conversation is rendered with every known reply spliced in as its exact sampled ids; sampled
  tokens after the first differing token are marked for a logprob recompute.
* Otherwise the call starts a new thread (sub-agents, side calls, compaction); a sub-agent whose
  first user message is the argument of an earlier tool call records that thread and call.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

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


def header_key(tools: list[ToolSpec], enable_thinking: bool | None) -> MessageKey:
    return (
        tuple((t.name, t.description, json.dumps(t.parameters, sort_keys=True)) for t in tools),
        enable_thinking,
    )


@dataclass
class TurnSpan:
    """One policy reply inside a thread: ``ids[start:end]`` are its sampled tokens."""

    request_id: str
    turn_index: int
    start: int
    end: int
    finish_reason: str
    latency_s: float
    backend: str
    reply_key: MessageKey = ()
    dropped: bool = False  # a later rewrite removed it from the thread's sequence

    def to_row(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "turn_index": self.turn_index,
            "start": self.start,
            "end": self.end,
            "finish_reason": self.finish_reason,
            "latency_s": self.latency_s,
            "backend": self.backend,
            "dropped": self.dropped,
        }


@dataclass
class Thread:
    thread_id: str
    session_id: str
    header: MessageKey
    parent_thread_id: str | None = None
    parent_tool_call_id: str | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    provenance: list[int] = field(default_factory=list)
    keys: list[MessageKey] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)
    # Every reply the policy gave in this thread, by message key: its exact sampled ids.
    replies: dict[MessageKey, list[int]] = field(default_factory=dict)
    version: int = 0
    # Written to a shard already (the session went idle): a call that continues it starts a
    # new thread from its exact ids, so no token is trained twice.
    sealed: bool = False

    def check(self) -> None:
        assert len(self.ids) == len(self.logprobs) == len(self.provenance)

    def loss_mask(self) -> list[int]:
        return [1 if p in TRAINED else 0 for p in self.provenance]


@dataclass
class Assembly:
    """The prompt for one call, and how it changes its thread once the call completes."""

    thread: Thread
    is_new_thread: bool
    prompt_ids: list[int]
    # thread.ids[:base] are kept as they are; prompt_ids[base:] replace the rest.
    base: int
    suffix_logprobs: list[float]
    suffix_provenance: list[int]
    keys: list[MessageKey]
    thread_version: int
    kind: str  # "new" / "extend" / "rewrite"
    divergence: int | None = None  # first token that differs from the thread (rewrite)
    # Rewrite: where each known reply now sits in prompt_ids, by its message key.
    spliced: dict[MessageKey, tuple[int, int]] = field(default_factory=dict)

    def needs_recompute(self) -> list[int]:
        """Positions (in prompt_ids) whose logprobs must be re-scored."""
        return [
            self.base + i
            for i, p in enumerate(self.suffix_provenance)
            if p == Provenance.RECOMPUTED
        ]


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: long identical prefixes are the common case.
    step = 1024
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


# Shorter tool-call arguments ("ls", a path) end too many messages to mean a spawn.
MIN_SPAWN_PROMPT = 16
_PLACEHOLDER = "\u0000AGENTTAP_REPLY_{}\u0000"
_DUMMY_USER = "\u0000AGENTTAP_DUMMY_USER\u0000"
_DUMMY_REPLY = "\u0000AGENTTAP_DUMMY_REPLY\u0000"


class ThreadSet:
    """The threads of one session, and the assembly of each call's prompt."""

    def __init__(self, session_id: str, renderer: Renderer, recompute: bool = True) -> None:
        self.session_id = session_id
        self.renderer = renderer
        self.recompute = recompute
        self.threads: dict[str, Thread] = {}
        # String values of tool-call arguments the policy produced: a sub-agent's first user
        # message equal to one of them was spawned by that call.
        self._spawn_index: dict[str, tuple[str, str]] = {}
        tail = renderer.assistant_tail
        self._tail_text: str = tail.text
        self._tail_ids: list[int] = list(tail.ids) or [-1]
        # The tail's first token is the template's end-of-turn token, e.g. "<|im_end|>".
        self._end_token_text = next(
            (
                self._tail_text[:n]
                for n in range(1, len(self._tail_text) + 1)
                if renderer.encode(self._tail_text[:n]) == self._tail_ids[:1]
            ),
            "",
        )

    # -- assembly ---------------------------------------------------------------------------
    def assemble(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        enable_thinking: bool | None,
    ) -> Assembly:
        keys = [message_key(m) for m in messages]
        header = header_key(tools, enable_thinking)
        best: Thread | None = None
        best_len = -1
        for thread in self.threads.values():
            if thread.header != header:
                continue
            n = self._common_keys(thread.keys, keys)
            if n > best_len:
                best, best_len = thread, n
        if (
            best is not None
            and best_len == len(best.keys)
            and len(keys) > best_len
            and best.turns
            and best.keys[-1][0] == "assistant"
        ):
            return self._extend(best, messages, keys, enable_thinking)
        # History that holds our replies but is not an extension was rewritten by the scaffold:
        # it stays on the thread whose replies it holds most of.
        replies_in_request = [k for k in keys if k[0] == "assistant"]
        owner, owned = None, 0
        for thread in self.threads.values():
            if thread.header != header:
                continue
            n = sum(1 for k in replies_in_request if k in thread.replies)
            if n > owned:
                owner, owned = thread, n
        if owner is not None:
            return self._rewrite(owner, messages, tools, keys, enable_thinking)
        return self._new_thread(messages, tools, keys, header, enable_thinking)

    @staticmethod
    def _common_keys(a: list[MessageKey], b: list[MessageKey]) -> int:
        n = min(len(a), len(b))
        if a[:n] == b[:n]:  # the common case, compared in C
            return n
        for i in range(n):
            if a[i] != b[i]:
                return i
        return n

    def _closing_ids(self, thread: Thread) -> list[int]:
        """The template's closing tokens after the thread's last reply."""
        last = thread.turns[-1]
        sampled = thread.ids[last.start : last.end]
        if sampled and self._tail_ids and sampled[-1] == self._tail_ids[0]:
            return self._tail_ids[1:]  # the reply ended with the template's own end token
        return list(self._tail_ids)

    def render_delta(self, new: list[Message], enable_thinking: bool | None) -> list[int]:
        """Ids of ``new`` messages as the template renders them after an assistant turn,
        plus the generation prompt; costs time proportional to ``new`` only."""
        dummy = [Message("user", _DUMMY_USER), Message("assistant", _DUMMY_REPLY)]
        text = self.renderer.render_text(
            dummy + new, None, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        cut = text.index(_DUMMY_REPLY) + len(_DUMMY_REPLY)
        if not text.startswith(self._tail_text, cut):
            raise ValueError("chat template closes assistant turns inconsistently")
        return self.renderer.encode(text[cut + len(self._tail_text) :])

    def _extend(
        self,
        thread: Thread,
        messages: list[Message],
        keys: list[MessageKey],
        enable_thinking: bool | None,
    ) -> Assembly:
        suffix = self._closing_ids(thread) + self.render_delta(
            messages[len(thread.keys) :], enable_thinking
        )
        return Assembly(
            thread=thread,
            is_new_thread=False,
            prompt_ids=thread.ids + suffix,
            base=len(thread.ids),
            suffix_logprobs=[0.0] * len(suffix),
            suffix_provenance=[Provenance.PROMPT] * len(suffix),
            keys=keys,
            thread_version=thread.version,
            kind="extend",
        )

    def render_spliced(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        replies: dict[MessageKey, list[int]],
        enable_thinking: bool | None,
    ) -> tuple[list[int], dict[MessageKey, tuple[int, int]]]:
        """Render the whole conversation, with each known reply's exact sampled ids spliced in.

        Returns the ids and where each spliced reply sits in them, by its message key.
        """
        shown: list[Message] = []
        spliced: list[MessageKey] = []
        for m in messages:
            key = message_key(m)
            if m.role == "assistant" and key in replies:
                shown.append(Message("assistant", _PLACEHOLDER.format(len(spliced))))
                spliced.append(key)
            else:
                shown.append(m)
        text = self.renderer.render_text(
            shown, tools or None, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        ids: list[int] = []
        spans: dict[MessageKey, tuple[int, int]] = {}
        rest = text
        end_token = self._end_token_text
        for k, key in enumerate(spliced):
            before, _, rest = rest.partition(_PLACEHOLDER.format(k))
            ids.extend(self.renderer.encode(before))
            sampled = replies[key]
            spans[key] = (len(ids), len(ids) + len(sampled))
            ids.extend(sampled)
            if sampled and sampled[-1] == self._tail_ids[0] and rest.startswith(end_token):
                # The reply carries the template's end-of-turn token itself: skip the copy.
                rest = rest[len(end_token) :]
        ids.extend(self.renderer.encode(rest))
        return ids, spans

    def _rewrite(
        self,
        thread: Thread,
        messages: list[Message],
        tools: list[ToolSpec],
        keys: list[MessageKey],
        enable_thinking: bool | None,
    ) -> Assembly:
        ids, spans = self.render_spliced(messages, tools, thread.replies, enable_thinking)
        p = _lcp(ids, thread.ids)
        base = p
        suffix_prov = [int(Provenance.PROMPT)] * (len(ids) - base)
        for start, end in spans.values():
            for pos in range(max(start, base), end):
                suffix_prov[pos - base] = (
                    Provenance.RECOMPUTED if self.recompute else Provenance.STALE
                )
        # STALE tokens keep no trained logprob; RECOMPUTED ones are filled in by the caller.
        return Assembly(
            thread=thread,
            is_new_thread=False,
            prompt_ids=ids,
            base=base,
            suffix_logprobs=[0.0] * (len(ids) - base),
            suffix_provenance=suffix_prov,
            keys=keys,
            thread_version=thread.version,
            kind="rewrite",
            divergence=p,
            spliced=spans,
        )

    def _new_thread(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        keys: list[MessageKey],
        header: MessageKey,
        enable_thinking: bool | None,
    ) -> Assembly:
        thread = Thread(
            thread_id=f"{len(self.threads)}-{uuid.uuid4().hex[:8]}",
            session_id=self.session_id,
            header=header,
        )
        first_user = next((m.content.strip() for m in messages if m.role == "user"), None)
        spawn = self._spawned_by(first_user) if first_user else None
        if spawn is not None:
            thread.parent_thread_id, thread.parent_tool_call_id = spawn
        ids = self.renderer.encode(
            self.renderer.render_text(
                messages, tools or None, add_generation_prompt=True, enable_thinking=enable_thinking
            )
        )
        return Assembly(
            thread=thread,
            is_new_thread=True,
            prompt_ids=ids,
            base=0,
            suffix_logprobs=[0.0] * len(ids),
            suffix_provenance=[Provenance.PROMPT] * len(ids),
            keys=keys,
            thread_version=0,
            kind="new",
        )

    def _spawned_by(self, first_user: str) -> tuple[str, str] | None:
        """The (thread, tool call) whose string argument opened this conversation.

        Exact match first; else the longest argument the first user message ends with, since
        scaffolds put context blocks (Claude Code: a ``<system-reminder>``) before the prompt.
        """
        exact = self._spawn_index.get(first_user)
        if exact is not None:
            return exact
        best: str | None = None
        for value in self._spawn_index:
            if len(value) >= MIN_SPAWN_PROMPT and first_user.endswith(value):
                if best is None or len(value) > len(best):
                    best = value
        return self._spawn_index[best] if best is not None else None

    def seal(self) -> list[Thread]:
        """Threads with calls not yet in a shard, now marked as written."""
        fresh = [t for t in self.threads.values() if t.turns and not t.sealed]
        for thread in self.threads.values():
            thread.sealed = True
        return fresh

    # -- commit -----------------------------------------------------------------------------
    def commit(
        self,
        assembly: Assembly,
        reply: Message,
        sampled_ids: list[int],
        sampled_logprobs: list[float],
        *,
        request_id: str,
        turn_index: int,
        finish_reason: str,
        latency_s: float,
        backend: str,
    ) -> Thread:
        """Apply a completed call to its thread (a new thread if it changed meanwhile)."""
        thread = assembly.thread
        if not assembly.is_new_thread and (
            thread.version != assembly.thread_version or thread.sealed
        ):
            # Another call on this thread completed first (a client retry, parallel calls), or
            # the thread is already in a shard: this one continues as a thread of its own.
            thread = Thread(
                thread_id=f"{len(self.threads)}-{uuid.uuid4().hex[:8]}",
                session_id=self.session_id,
                header=assembly.thread.header,
                parent_thread_id=assembly.thread.thread_id,
            )
            prefix_ids = assembly.prompt_ids[: assembly.base]
            old = assembly.thread
            n = _lcp(prefix_ids, old.ids)
            thread.ids = list(prefix_ids)
            # Tokens shared with the parent are trained there, not twice.
            thread.logprobs = old.logprobs[:n] + [0.0] * (len(prefix_ids) - n)
            thread.provenance = [int(Provenance.PROMPT)] * len(prefix_ids)
            # Its replies are still known: a later rewrite can splice them.
            thread.replies = dict(old.replies)
        if assembly.is_new_thread or thread.thread_id not in self.threads:
            self.threads[thread.thread_id] = thread
        base = assembly.base
        thread.ids[base:] = assembly.prompt_ids[base:]
        thread.logprobs[base:] = assembly.suffix_logprobs
        thread.provenance[base:] = [int(p) for p in assembly.suffix_provenance]
        if assembly.kind == "rewrite":
            # Each earlier reply now sits where it was spliced, or is gone from the sequence
            # (its call's own record still holds it).
            for turn in thread.turns:
                span = assembly.spliced.get(turn.reply_key)
                if span is None:
                    turn.dropped = True
                else:
                    turn.start, turn.end = span
        start = len(thread.ids)
        thread.ids.extend(sampled_ids)
        thread.logprobs.extend(sampled_logprobs)
        thread.provenance.extend([int(Provenance.SAMPLED)] * len(sampled_ids))
        thread.turns.append(
            TurnSpan(
                request_id=request_id,
                turn_index=turn_index,
                start=start,
                end=len(thread.ids),
                finish_reason=finish_reason,
                latency_s=latency_s,
                backend=backend,
                reply_key=message_key(reply),
            )
        )
        reply_key = message_key(reply)
        thread.keys = list(assembly.keys) + [reply_key]
        thread.replies[reply_key] = list(sampled_ids)
        thread.version += 1
        for call in reply.tool_calls:
            args = call.arguments_object()
            if isinstance(args, dict):
                for value in args.values():
                    if isinstance(value, str) and len(value.strip()) >= 8:
                        self._spawn_index[value.strip()] = (thread.thread_id, call.id)
        thread.check()
        return thread
