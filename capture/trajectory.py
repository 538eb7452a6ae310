"""Token-exact trajectories: every policy call is a node in a tree; training rows are its paths.

Pure core: plain dataclasses and functions over token ids and canonical messages; no HTTP, no
mitmproxy, no vLLM. The one outside dependency is a renderer (``rewriter.template.ChatTemplate``).

A *call* (:class:`Call`) is one completed policy request: the exact prompt ids vLLM saw and the ids
it sampled. Calls form a tree per session: a call's parent is the earlier call whose conversation
its prompt continues. When a scaffold sends its next request, its history holds the assistant
messages we returned, re-serialized (reasoning dropped, tool-call arguments re-encoded, ids maybe
renamed). The request is placed in the tree, strongest evidence first:

* Extension (the common case): the request's messages extend a call's conversation exactly
  (normalized keys). Prompt = that call's prompt + sampled ids + the template's closing tokens +
  only the new messages rendered. Among equal candidates (identical conversations: two sub-agents
  given the same task, a policy that repeats itself) the one whose minted tool-call ids the request
  echoes wins, then one not yet continued, then the most recent.
* Retry: the request is one already answered (a scaffold's timeout, a 529 retry): the new call is a
  sibling of the earlier one, with the same prompt ids.
* Rewrite: the history holds our replies but is not an extension (a ``<system-reminder>`` injected
  into an old turn, an edited tool result). Its owner is the call whose path of replies aligns best
  with the request's assistant messages, in order (echoed tool-call ids first, then keys); among
  equals the one whose replies the request holds all of, then the most recent. The conversation is
  rendered whole with each aligned reply spliced in as its exact sampled ids; sampled tokens after
  the first differing token are marked for a logprob recompute.
* Otherwise the call starts a new tree (sub-agents, side calls, compaction); a sub-agent whose first
  user message is the argument of an earlier tool call, or a conversation that opens with the
  summary an earlier call wrote, is linked to that call.

Rows are derived, not accumulated (:func:`export_rows`): a row is the sequence of the last call of a
chain of *main* children (its ``input_ids`` are exactly that call's prompt + sampled ids), and
every call is trained in exactly one row, the one its main children lead to (a continued child
before one that was not, then the last sent). Its other rows carry its tokens as context, masked.
A call never continued, for which the client sent the same request again (its SDK's retry marker,
or the resend was continued), is a *dead* branch: never a main child, trained in a row of its own
flagged ``dead``, never in the live row. Identical calls with no such evidence are parallel calls:
all live. A call the client's later history removed (a rewrite that dropped turns) is trained in
a ``rewritten`` row of the sequence it was removed from.
"""

from __future__ import annotations

import functools
import json
import time
import zlib
from array import array
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


@dataclass(eq=False)
class Call:
    """One completed policy call, as a node of its session's tree."""

    uid: int  # completion order within the session
    request_id: str
    turn_index: int
    finish_reason: str
    latency_s: float
    backend: str
    parent: Call | None
    kind: str  # "new" / "extend" / "rewrite" (a retry repeats its sibling's kind)
    prompt_len: int
    sampled_ids: list[int]
    sampled_logprobs: list[float]
    # Its own prompt + sampled ids; released (None) once an extension child holds them as its
    # prompt's prefix, so a long conversation keeps one copy of its tokens, not one per call.
    prompt_ids: list[int] | None
    # prompt_ids[:base] are the parent's sequence unchanged; the rest is new in this call, with
    # these logprobs and provenance (None: all template/scaffold text, logprob 0).
    base: int
    suffix_logprobs: list[float] | None
    suffix_provenance: list[int] | None
    # Rewrite: earlier calls of the path whose sampled ids sit in prompt_ids[start:end].
    spliced: list[tuple[Call, int, int]] = field(default_factory=list)
    # SAMPLED; RECOMPUTED or STALE for a schema-constrained completion (see ThreadSet.commit).
    sampled_provenance: int = Provenance.SAMPLED
    # crc32 of the prompt ids.
    prompt_digest: int = 0
    # crc32 chains over the header and message keys: of the request, and of the request plus
    # the reply. Calls with one request after calls with one conversation are resends of each
    # other, even where the earlier calls are indistinguishable twins.
    request_digest: int = 0
    conv_digest: int = 0
    spawned_by: tuple[Call, str] | None = None  # (call, tool-call id) whose argument opened it
    compaction_of: Call | None = None  # the call whose summary this conversation opens with
    children: list[Call] = field(default_factory=list)
    # Matching state (live sessions only; not needed to export rows).
    header: MessageKey = ()
    conv: list[MessageKey] = field(default_factory=list)  # request keys + reply key
    tool_ids: frozenset[str] = frozenset()  # minted ids the client echoes: tool calls, replies
    claims: dict[int, float] = field(default_factory=dict)  # in-flight requests extending it
    written_in: str | None = None  # thread id of the row it was trained in, once written
    dead: bool = False  # written in a dead row
    replaced_by: Call | None = None  # dead: the resend the client went on with
    started: int = 0  # arrival order of its request (a retry arrives after what it retries)
    client_retry: bool = False  # its client marked the request as a retry
    # Recovered from a journal whose earlier calls were written already: the row it continues.
    parent_row: str | None = None

    @property
    def seq_len(self) -> int:
        return self.prompt_len + len(self.sampled_ids)

    def ancestors(self) -> list[Call]:
        """Root first, this call last."""
        path: list[Call] = []
        node: Call | None = self
        while node is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path


def _digest(ids: list[int]) -> int:
    return zlib.crc32(array("q", ids).tobytes())


def _fold(digest: int, keys: list[MessageKey]) -> int:
    for key in keys:
        digest = zlib.crc32(repr(key).encode("utf-8", "surrogatepass"), digest)
    return digest


@dataclass
class Assembly:
    """The prompt for one call, and where the call goes in the tree once it completes."""

    parent: Call | None
    prompt_ids: list[int]
    # prompt_ids[:base] are the parent's sequence as it is; the rest is new.
    base: int
    suffix_logprobs: list[float]
    suffix_provenance: list[int]
    keys: list[MessageKey]
    header: MessageKey
    kind: str  # "new" / "extend" / "retry" / "rewrite"
    divergence: int | None = None  # first token that differs from the parent's sequence
    spliced: list[tuple[Call, int, int]] = field(default_factory=list)
    spawned_by: tuple[Call, str] | None = None
    compaction_of: Call | None = None
    claim: int = 0
    started: int = 0  # order in which the session's requests arrived
    client_retry: bool = False
    # A retry: the earlier call with this very request (its prompt is reused as it is).
    sibling_of: Call | None = None

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


# Tool-call argument values remembered per session for spawn links (a sub-agent starts soon
# after the call that spawned it): bounded, so arguments cannot grow memory without end.
MAX_SPAWN_VALUES = 4096
# Shorter tool-call arguments ("ls", a path) end too many messages to mean a spawn.
MIN_SPAWN_PROMPT = 16
# A reply shorter than this is not taken for a summary that a compacted conversation opens with.
MIN_SUMMARY_CHARS = 200
SUMMARY_PROBES = 4
# Rewrite owners are scored in full for this many candidates (the best by a cheap pre-score).
MAX_REWRITE_CANDIDATES = 16
# A claim on a call (an in-flight request extending it) older than this is ignored: that request
# failed or its client left, and never completed.
CLAIM_TTL_S = 600.0
_PLACEHOLDER = "\u0000AGENTTAP_REPLY_{}\u0000"
_DUMMY_USER = "\u0000AGENTTAP_DUMMY_USER\u0000"
_DUMMY_REPLY = "\u0000AGENTTAP_DUMMY_REPLY\u0000"


class ThreadSet:
    """The calls of one session (a forest), the assembly of each prompt, and its rows."""

    def __init__(self, session_id: str, renderer: Renderer, recompute: bool = True) -> None:
        self.session_id = session_id
        self.renderer = renderer
        self.recompute = recompute
        self.calls: list[Call] = []
        self._by_reply: dict[MessageKey, list[Call]] = {}
        self._by_tool_id: dict[str, Call] = {}
        self._by_len: dict[int, list[Call]] = {}  # calls by the length of their conversation
        # String values of tool-call arguments the policy produced: a sub-agent's first user
        # message equal to one of them was spawned by that call. Several calls may share a value
        # (two sub-agents given the same task): each spawn takes the first one not yet taken.
        self._spawn_index: dict[str, list[tuple[Call, str]]] = {}
        self._spawns_taken: set[tuple[int, str]] = set()
        # Long replies (summaries): probes of their text -> call.
        self._summaries: list[tuple[Call, list[str]]] = []
        self._claims = 0
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
        client_retry: bool = False,
    ) -> Assembly:
        """Where a request goes in the tree, and its prompt ids. ``client_retry``: the client
        says this request is a retry of one it sent before (its SDK's retry counter)."""
        assembly = self._assemble(messages, tools, enable_thinking, client_retry)
        assembly.client_retry = client_retry
        return assembly

    def _assemble(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        enable_thinking: bool | None,
        client_retry: bool,
    ) -> Assembly:
        keys = [message_key(m) for m in messages]
        header = header_key(tools, enable_thinking)
        id_calls = self._id_evidence(messages)
        parent = self._extension_parent(keys, header, id_calls, client_retry)
        if parent is not None and any(
            keys[i][0] == "assistant" and keys[i] in self._by_reply
            for i in range(len(parent.conv), len(keys))
        ):
            # Replies of ours after the extended conversation: if another path holds more of the
            # request's replies, in order, the request is that conversation, rewritten.
            owner = self._rewrite_owner(messages, keys, header, id_calls)
            if owner is not None and len(owner[1]) > len(parent.ancestors()):
                call, aligned = owner
                return self._claim(
                    self._rewrite(call, aligned, messages, tools, keys, header, enable_thinking)
                )
        # A request its client marks as a retry goes beside the call it repeats, if there is one.
        sibling = self._answered(keys, header, id_calls) if client_retry else None
        if sibling is None and parent is not None and not self._busy(parent):
            return self._claim(self._extend(parent, messages, keys, header, enable_thinking))
        if sibling is None:
            sibling = self._answered(keys, header, id_calls)
        if sibling is not None and sibling.parent is None and self._untaken_spawn(messages):
            sibling = None  # the same task given to another sub-agent, not a retry
        if sibling is not None:
            return self._claim(self._retry(sibling, keys))
        if parent is not None:  # fan-out: a second continuation of the same call
            return self._claim(self._extend(parent, messages, keys, header, enable_thinking))
        owner = self._rewrite_owner(messages, keys, header, id_calls)
        if owner is not None:
            call, aligned = owner
            return self._claim(
                self._rewrite(call, aligned, messages, tools, keys, header, enable_thinking)
            )
        return self._claim(
            self._new_thread(messages, tools, keys, header, enable_thinking, client_retry)
        )

    def _id_evidence(self, messages: list[Message]) -> dict[int, Call]:
        """Message index -> the call whose minted ids that assistant message echoes: its
        tool-call ids, or the reply ids a provider keeps on the message (a Responses API
        response named by its items' ids)."""
        found: dict[int, Call] = {}
        by_id = self._by_tool_id
        if not by_id:
            return found
        # Every call resends the whole history: kept to one dict lookup per tool call.
        for i, m in enumerate(messages):
            if m.role != "assistant":
                continue
            for reply_id in m.ids:
                call = by_id.get(reply_id)
                if call is not None:
                    found[i] = call
                    break
            else:
                for tool_call in m.tool_calls:
                    call = by_id.get(tool_call.id)
                    if call is not None:
                        found[i] = call
                        break
        return found

    def _holds_later_replies(
        self, parent: Call, keys: list[MessageKey], id_calls: dict[int, Call]
    ) -> bool:
        """Whether the messages after ``parent``'s conversation hold a reply of one of its
        continuations (an earlier turn was edited): then the request is a rewrite."""
        for i in range(len(parent.conv), len(keys)):
            if keys[i][0] != "assistant":
                continue
            if i in id_calls or any(c.conv[-1] == keys[i] for c in parent.children):
                return True
        return False

    def _busy(self, call: Call) -> bool:
        """Continued already, or an in-flight request is extending it."""
        if call.children:
            return True
        now = time.monotonic()
        return any(now - t < CLAIM_TTL_S for t in call.claims.values())

    def _claim(self, assembly: Assembly) -> Assembly:
        self._claims += 1
        assembly.started = self._claims
        if assembly.parent is not None:
            self._claims += 1
            assembly.claim = self._claims
            assembly.parent.claims[assembly.claim] = time.monotonic()
        return assembly

    def release(self, assembly: Assembly) -> None:
        """The call will not complete (policy error, client gone): drop its claim."""
        if assembly.parent is not None:
            assembly.parent.claims.pop(assembly.claim, None)

    def _path_id_score(
        self, call: Call, id_calls: dict[int, Call], path: list[Call] | None = None
    ) -> int:
        """How many of the calls the request's echoed ids name lie on ``call``'s path
        (``path``: its ancestors, where the caller has them already)."""
        if not id_calls:
            return 0
        on_path = set(map(id, path if path is not None else call.ancestors()))
        return sum(1 for c in id_calls.values() if id(c) in on_path)

    def _consistent(self, cands: list[Call], id_calls: dict[int, Call]) -> list[Call]:
        """The candidates whose path holds every call the request's echoed tool-call ids name
        (a twin conversation with the same text is not the one the client continues)."""
        if not id_calls:
            return cands
        need = len(id_calls)
        return [c for c in cands if self._path_id_score(c, id_calls) == need]

    def _extension_parent(
        self,
        keys: list[MessageKey],
        header: MessageKey,
        id_calls: dict[int, Call],
        client_retry: bool = False,
    ) -> Call | None:
        """The deepest call whose conversation the request extends exactly. Among equals: the
        one whose tool-call ids the request echoes; then one not yet continued (or, for a
        client's retry, one already being continued: by the request it repeats); then the
        latest."""
        for i in range(len(keys) - 2, -1, -1):
            key = keys[i]
            if key[0] != "assistant":
                continue
            n = i + 1
            cands = [
                c
                for c in self._by_reply.get(key, ())
                if len(c.conv) == n
                and c.header == header
                and (c.prompt_ids is not None or c.children)
                and c.conv == keys[:n]
            ]
            cands = self._consistent(cands, id_calls)
            if cands:
                if any(self._holds_later_replies(c, keys, id_calls) for c in cands):
                    return None  # the history goes on past them with our replies: a rewrite
                return max(
                    cands,
                    key=lambda c: (
                        self._path_id_score(c, id_calls),
                        self._busy(c) == client_retry,
                        c.uid,
                    ),
                )
        return None

    def _answered(
        self, keys: list[MessageKey], header: MessageKey, id_calls: dict[int, Call]
    ) -> Call | None:
        """The latest call that was sent this very request (so this one is a retry)."""
        if not keys or keys[-1][0] == "assistant":
            return None
        pool = self._by_len.get(len(keys) + 1, [])
        cands = [
            c
            for c in pool
            if c.header == header
            and len(c.conv) == len(keys) + 1
            and c.prompt_ids is not None
            and c.conv[:-1] == keys
        ]
        cands = self._consistent(cands, id_calls)
        if not cands:
            return None
        return max(cands, key=lambda c: (self._path_id_score(c, id_calls), c.uid))

    def _closing_ids(self, call: Call) -> list[int]:
        """The template's closing tokens after the call's reply."""
        sampled = call.sampled_ids
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
        parent: Call,
        messages: list[Message],
        keys: list[MessageKey],
        header: MessageKey,
        enable_thinking: bool | None,
    ) -> Assembly:
        suffix = self._closing_ids(parent) + self.render_delta(
            messages[len(parent.conv) :], enable_thinking
        )
        prefix = seq_ids(parent)
        return Assembly(
            parent=parent,
            prompt_ids=prefix + suffix,
            base=len(prefix),
            suffix_logprobs=[0.0] * len(suffix),
            suffix_provenance=[int(Provenance.PROMPT)] * len(suffix),
            keys=keys,
            header=header,
            kind="extend",
        )

    def _retry(self, sibling: Call, keys: list[MessageKey]) -> Assembly:
        assert sibling.prompt_ids is not None
        n = sibling.prompt_len - sibling.base
        return Assembly(
            parent=sibling.parent,
            prompt_ids=sibling.prompt_ids,
            base=sibling.base,
            # Same prompt, same context: a recompute the sibling needed holds for this one too.
            suffix_logprobs=list(sibling.suffix_logprobs or [0.0] * n),
            suffix_provenance=list(sibling.suffix_provenance or [int(Provenance.PROMPT)] * n),
            keys=keys,
            header=sibling.header,
            kind="retry",
            spliced=list(sibling.spliced),
            spawned_by=sibling.spawned_by,
            compaction_of=sibling.compaction_of,
            sibling_of=sibling,
        )

    # -- rewrites ---------------------------------------------------------------------------
    def _rewrite_owner(
        self,
        messages: list[Message],
        keys: list[MessageKey],
        header: MessageKey,
        id_calls: dict[int, Call],
    ) -> tuple[Call, dict[int, Call]] | None:
        """The call whose path of replies the request's history aligns with best, and which
        request message (index) is which call's reply."""
        asst = [i for i, k in enumerate(keys) if k[0] == "assistant"]
        if not asst:
            return None
        cands: dict[int, Call] = {}
        for i in asst:
            for c in self._by_reply.get(keys[i], ()):
                if c.header == header:
                    cands[c.uid] = c
        for c in id_calls.values():
            if c.header == header:
                cands[c.uid] = c
        if not cands:
            return None
        asst_keys = {keys[i] for i in asst}

        def prescore(c: Call) -> tuple[int, int, int]:
            # Echoed ids first: with many calls sharing a reply text ("Done.", the same tool
            # call), the cut below must never drop the call the client's ids name.
            path = c.ancestors()
            on_path = sum(1 for a in path if a.conv and a.conv[-1] in asst_keys)
            return (self._path_id_score(c, id_calls, path), on_path, c.uid)

        ranked = sorted(cands.values(), key=prescore, reverse=True)[:MAX_REWRITE_CANDIDATES]
        best: tuple[tuple[int, ...], Call, dict[int, Call]] | None = None
        for c in ranked:
            path = c.ancestors()
            aligned, id_hits = _align_replies(asst, keys, id_calls, path)
            if not aligned:
                continue
            holds_all = len(aligned) == len(path)
            positional, similar = _positional_agreement(keys, c.conv)
            score = (id_hits, len(aligned), int(holds_all), positional, similar, c.uid)
            if best is None or score > best[0]:
                best = (score, c, aligned)
        return None if best is None else (best[1], best[2])

    def render_spliced(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        splice: dict[int, list[int]],
        enable_thinking: bool | None,
    ) -> tuple[list[int], dict[int, tuple[int, int]]]:
        """Render the whole conversation, with the assistant messages at ``splice``'s indices
        replaced by their exact sampled ids. Returns the ids and where each spliced reply sits
        in them, by message index."""
        shown: list[Message] = []
        order: list[int] = []
        for i, m in enumerate(messages):
            if i in splice:
                shown.append(Message("assistant", _PLACEHOLDER.format(len(order))))
                order.append(i)
            else:
                shown.append(m)
        text = self.renderer.render_text(
            shown, tools or None, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        ids: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        rest = text
        end_token = self._end_token_text
        for k, i in enumerate(order):
            before, _, rest = rest.partition(_PLACEHOLDER.format(k))
            ids.extend(self.renderer.encode(before))
            sampled = splice[i]
            spans[i] = (len(ids), len(ids) + len(sampled))
            ids.extend(sampled)
            if sampled and sampled[-1] == self._tail_ids[0] and rest.startswith(end_token):
                # The reply carries the template's end-of-turn token itself: skip the copy.
                rest = rest[len(end_token) :]
        ids.extend(self.renderer.encode(rest))
        return ids, spans

    def _rewrite(
        self,
        owner: Call,
        aligned: dict[int, Call],
        messages: list[Message],
        tools: list[ToolSpec],
        keys: list[MessageKey],
        header: MessageKey,
        enable_thinking: bool | None,
    ) -> Assembly:
        splice = {i: call.sampled_ids for i, call in aligned.items()}
        ids, spans = self.render_spliced(messages, tools, splice, enable_thinking)
        p = _lcp(ids, seq_ids(owner))
        base = p
        suffix_prov = [int(Provenance.PROMPT)] * (len(ids) - base)
        moved = Provenance.RECOMPUTED if self.recompute else Provenance.STALE
        for start, end in spans.values():
            for pos in range(max(start, base), end):
                suffix_prov[pos - base] = int(moved)
        # STALE tokens keep no trained logprob; RECOMPUTED ones are filled in by the caller.
        return Assembly(
            parent=owner,
            prompt_ids=ids,
            base=base,
            suffix_logprobs=[0.0] * (len(ids) - base),
            suffix_provenance=suffix_prov,
            keys=keys,
            header=header,
            kind="rewrite",
            divergence=p,
            spliced=[(aligned[i], s, e) for i, (s, e) in sorted(spans.items())],
        )

    # -- new conversations ------------------------------------------------------------------
    def _new_thread(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        keys: list[MessageKey],
        header: MessageKey,
        enable_thinking: bool | None,
        client_retry: bool = False,
    ) -> Assembly:
        first_user = next((m.content.strip() for m in messages if m.role == "user"), None)
        spawn = self._spawned_by(first_user, client_retry) if first_user else None
        if spawn is not None:
            # Taken now, not at commit: a parallel twin sub-agent takes the next spawning call.
            self._spawns_taken.add((spawn[0].uid, spawn[1]))
        compaction = None if spawn else self._compaction_of(messages, header)
        ids = self.renderer.encode(
            self.renderer.render_text(
                messages, tools or None, add_generation_prompt=True, enable_thinking=enable_thinking
            )
        )
        return Assembly(
            parent=None,
            prompt_ids=ids,
            base=0,
            suffix_logprobs=[0.0] * len(ids),
            suffix_provenance=[int(Provenance.PROMPT)] * len(ids),
            keys=keys,
            header=header,
            kind="new",
            spawned_by=spawn,
            compaction_of=compaction,
        )

    def _untaken_spawn(self, messages: list[Message]) -> bool:
        first_user = next((m.content.strip() for m in messages if m.role == "user"), None)
        spawn = self._spawned_by(first_user) if first_user else None
        return spawn is not None and (spawn[0].uid, spawn[1]) not in self._spawns_taken

    def _spawned_by(self, first_user: str, retry: bool = False) -> tuple[Call, str] | None:
        """The (call, tool call) whose string argument opened this conversation.

        Exact match first; else the longest argument the first user message ends with, since
        scaffolds put context blocks (Claude Code: a ``<system-reminder>``) before the prompt.
        """
        options = self._spawn_index.get(first_user)
        if options is None:
            best: str | None = None
            for value in self._spawn_index:
                if len(value) >= MIN_SPAWN_PROMPT and first_user.endswith(value):
                    if best is None or len(value) > len(best):
                        best = value
            if best is None:
                return None
            options = self._spawn_index[best]
        taken = [o for o in options if (o[0].uid, o[1]) in self._spawns_taken]
        if retry and taken:
            return taken[-1]  # a retry repeats the sub-agent's own first request
        for call, tool_id in options:
            if (call.uid, tool_id) not in self._spawns_taken:
                return call, tool_id
        return options[-1]

    def _compaction_of(self, messages: list[Message], header: MessageKey) -> Call | None:
        """The call whose long reply (a summary) this new conversation's user text holds."""
        if not self._summaries:
            return None
        text = " ".join(" ".join(m.content.split()) for m in messages if m.role == "user")
        if len(text) < MIN_SUMMARY_CHARS:
            return None
        for call, probes in reversed(self._summaries):
            if sum(1 for p in probes if p in text) >= max(2, len(probes) - 1):
                return call
        return None

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
        sampled_provenance: int = Provenance.SAMPLED,
    ) -> Call:
        """Add a completed call to the tree, where its assembly placed it.

        ``sampled_provenance``: RECOMPUTED where ``sampled_logprobs`` are a re-score rather than
        the sampler's (a completion constrained by a JSON schema: the sampler's logprobs are
        the constrained distribution's), STALE where no re-score could be had (masked)."""
        self.release(assembly)
        parent = assembly.parent
        if assembly.kind == "retry" and assembly.sibling_of is not None:
            kind = assembly.sibling_of.kind
        else:
            kind = assembly.kind
        prompt = assembly.prompt_ids
        all_prompt = all(p == Provenance.PROMPT for p in assembly.suffix_provenance)
        call = Call(
            uid=len(self.calls),
            request_id=request_id,
            turn_index=turn_index,
            finish_reason=finish_reason,
            latency_s=latency_s,
            backend=backend,
            parent=parent,
            kind=kind,
            prompt_len=len(prompt),
            sampled_ids=list(sampled_ids),
            sampled_logprobs=list(sampled_logprobs),
            sampled_provenance=int(sampled_provenance),
            prompt_ids=prompt,
            base=assembly.base,
            suffix_logprobs=None if all_prompt else list(assembly.suffix_logprobs),
            suffix_provenance=None if all_prompt else [int(p) for p in assembly.suffix_provenance],
            spliced=list(assembly.spliced),
            prompt_digest=_digest(prompt),
            spawned_by=assembly.spawned_by,
            compaction_of=assembly.compaction_of,
            header=assembly.header,
            started=assembly.started or len(self.calls) + 1,
            client_retry=assembly.client_retry,
            tool_ids=frozenset([*(c.id for c in reply.tool_calls if c.id), *reply.ids]),
        )
        reply_key = message_key(reply)
        keys = assembly.keys
        if kind == "extend" and parent is not None:
            # Share the parent's key tuples (and the text in them): a long conversation holds
            # each message's text once, not once per call.
            n = len(parent.conv)
            call.conv = parent.conv + keys[n:] + [reply_key]
            call.request_digest = _fold(parent.conv_digest, keys[n:])
        else:
            call.conv = list(keys) + [reply_key]
            call.request_digest = _fold(_fold(0, [assembly.header]), keys)
        call.conv_digest = _fold(call.request_digest, [reply_key])
        self.calls.append(call)
        if parent is not None:
            parent.children.append(call)
            if (
                kind == "extend"
                and call.base == parent.seq_len
                and parent.prompt_ids is not None
                and parent.written_in is None
            ):
                # This call's prompt starts with the parent's whole sequence: one copy is enough.
                parent.prompt_ids = None
        self._by_reply.setdefault(reply_key, []).append(call)
        self._by_len.setdefault(len(call.conv), []).append(call)
        for tool_id in call.tool_ids:
            self._by_tool_id[tool_id] = call
        for tool_call in reply.tool_calls:
            args = tool_call.arguments_object()
            if isinstance(args, dict):
                for value in args.values():
                    if isinstance(value, str) and len(value.strip()) >= 8:
                        self._spawn_index.setdefault(value.strip(), []).append((call, tool_call.id))
                        if len(self._spawn_index) > MAX_SPAWN_VALUES:  # oldest first
                            del self._spawn_index[next(iter(self._spawn_index))]
        summary = " ".join(reply.content.split())
        if len(summary) >= MIN_SUMMARY_CHARS:
            step = len(summary) // SUMMARY_PROBES
            probes = [summary[k * step : k * step + 48] for k in range(SUMMARY_PROBES)]
            self._summaries.append((call, probes))
            del self._summaries[:-256]
        return call

    # -- rows -------------------------------------------------------------------------------
    def export(self) -> tuple[list[ThreadRow], dict[str, str]]:
        """Rows holding calls not yet written; the calls are marked as written.

        Returns the rows and, per request id, the thread id of the row that trains that call
        (or, for a call trained nowhere, the row that says why)."""
        rows, thread_of = export_rows(self.calls)
        for call in self.calls:
            if call.written_in is None and call.request_id in thread_of:
                call.written_in = thread_of[call.request_id]
        dead = {rid for row in rows if row.dead for rid in row.trained_request_ids}
        for call in self.calls:
            if call.request_id in dead:
                call.dead = True
            elif call.written_in is not None and not call.dead:
                call.replaced_by = None
        return rows, thread_of


@dataclass
class ThreadRow:
    """One training row: a path of calls, and which of them it trains."""

    thread_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    provenance: list[int]
    turns: list[dict[str, Any]]
    parent_thread_id: str | None = None
    # "branch" (another continuation of the parent row's calls: a retry, a parallel call),
    # "continued" (the parent row was written while the session was idle), "spawn" (a sub-agent
    # the parent's tool call started), "compaction" (opens with the parent's summary),
    # "rewritten" (calls the client's later history removed from the parent row's conversation).
    parent_relation: str | None = None
    parent_tool_call_id: str | None = None
    dead: bool = False
    dead_reason: str | None = None  # "superseded": the same request was sent again and
    superseded_by: str | None = None  # this thread id's answer is the one the client went on with
    trained_request_ids: list[str] = field(default_factory=list)


def seq_ids(call: Call) -> list[int]:
    """A call's whole sequence: its prompt ids + sampled ids (a new list)."""
    if call.prompt_ids is not None:
        return call.prompt_ids + call.sampled_ids
    # Released: an extension descendant's prompt starts with exactly this sequence.
    node = call
    while node.prompt_ids is None:
        node = next(c for c in node.children if c.kind == "extend" and c.base == node.seq_len)
    return node.prompt_ids[: call.seq_len]


def export_rows(calls: list[Call]) -> tuple[list[ThreadRow], dict[str, str]]:
    """The rows for every call not yet written (``written_in`` is None).

    Each such call is trained in exactly one row: the one its main children lead to (``loss_mask``
    1 on its sampled tokens there), or, where the client's later history removed it, in a
    ``rewritten`` row of the sequence it was removed from. A call abandoned for a resend is never
    a main child: it ends a dead row of its own."""
    superseded = _supersessions(calls)

    def main_child(call: Call) -> Call | None:
        # The continuation a trainer should see: a continued child before one that was not,
        # then the last sent (the retry whose answer the client used).
        live = [c for c in call.children if c.uid not in superseded]
        return max(live, key=lambda c: (bool(c.children), c.started, c.uid)) if live else None

    end_cache: dict[int, Call] = {}

    def end_of(call: Call) -> Call:
        """The last call of the row that trains ``call``."""
        path = []
        node = call
        while node.uid not in end_cache:
            path.append(node)
            nxt = main_child(node)
            if nxt is None:
                break
            node = nxt
        end = end_cache.get(node.uid, node)
        for n in path:
            end_cache[n.uid] = end
        return end

    def row_id(call: Call) -> str:
        return call.written_in or "t-" + end_of(call).request_id

    assigned: dict[int, list[Call]] = {}
    for call in calls:
        if call.written_in is None:
            assigned.setdefault(end_of(call).uid, []).append(call)
    by_uid = {c.uid: c for c in calls}
    rows: list[ThreadRow] = []
    thread_of: dict[str, str] = {}
    for end_uid in sorted(assigned):
        end = by_uid[end_uid]
        mine = {c.uid for c in assigned[end_uid]}
        tid = "t-" + end.request_id
        row, removed = _compose(end, mine, tid, row_id)
        top = min(assigned[end_uid], key=lambda c: c.uid)
        _link(row, top, main_child, row_id, superseded)
        rows.append(row)
        for c in assigned[end_uid]:
            thread_of[c.request_id] = tid
        # Calls the client's later history removed: trained in the sequence they were cut from.
        for cut_at, cut in removed:
            side_id = f"{tid}/r{cut_at.uid}"
            side, _ = _compose(cut_at, {c.uid for c in cut}, side_id, row_id)
            side.parent_thread_id, side.parent_relation = tid, "rewritten"
            rows.append(side)
            for c in cut:
                thread_of[c.request_id] = side_id
            for turn in row.turns:
                if turn["request_id"] in side.trained_request_ids:
                    turn["trained_in"] = side_id
    return rows, thread_of


def _compose(
    leaf: Call, mine: set[int], thread_id: str, row_id: Any
) -> tuple[ThreadRow, list[tuple[Call, list[Call]]]]:
    """The row of ``leaf``'s sequence training the calls in ``mine``; and, per rewrite that
    removed some of them, (the call before it, the removed calls)."""
    path = leaf.ancestors()
    logprobs: list[float] = []
    provenance: list[int] = []
    spans: dict[int, tuple[int, int] | None] = {}
    cut_at: dict[int, Call] = {}  # uid -> the call after which a rewrite removed it
    for call in path:
        base = call.base
        del logprobs[base:]
        del provenance[base:]
        if call.kind == "rewrite" or base < (call.parent.seq_len if call.parent else 0):
            moved = {c.uid: (s, e) for c, s, e in call.spliced}
            for uid, span in spans.items():
                if uid in moved:
                    spans[uid] = moved[uid]
                elif span is not None and span[1] > base:
                    spans[uid] = None
                    if call.parent is not None:
                        cut_at[uid] = call.parent
        n = call.prompt_len - base
        logprobs += call.suffix_logprobs if call.suffix_logprobs is not None else [0.0] * n
        provenance += call.suffix_provenance if call.suffix_provenance is not None else [0] * n
        start = len(logprobs)
        logprobs += call.sampled_logprobs
        provenance += [int(call.sampled_provenance)] * len(call.sampled_ids)
        spans[call.uid] = (start, len(logprobs))
    ids = seq_ids(leaf)
    assert len(ids) == len(logprobs) == len(provenance), "a call's deltas do not compose"
    removed: list[tuple[Call, list[Call]]] = []
    for call in path:
        if call.uid in mine and spans[call.uid] is None and call.uid in cut_at:
            at = cut_at[call.uid]
            group = next((g for a, g in removed if a is at), None)
            if group is None:
                removed.append((at, [call]))
            else:
                group.append(call)
    mask = [0] * len(ids)
    turns: list[dict[str, Any]] = []
    trained: list[str] = []
    for call in path:
        span = spans[call.uid]
        if call.uid in mine:
            status = "trained" if span is not None else "dropped"
            trained_in = thread_id if span is not None else None
            if span is not None:
                trained.append(call.request_id)
                for pos in range(*span):
                    if provenance[pos] in TRAINED:
                        mask[pos] = 1
        else:
            status = "context" if span is not None else "dropped"
            trained_in = row_id(call)
        turns.append(
            {
                "request_id": call.request_id,
                "turn_index": call.turn_index,
                "start": span[0] if span else -1,
                "end": span[1] if span else -1,
                "finish_reason": call.finish_reason,
                "latency_s": call.latency_s,
                "backend": call.backend,
                "dropped": span is None,
                "status": status,
                "trained_in": trained_in,
            }
        )
    row = ThreadRow(
        thread_id=thread_id,
        input_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        provenance=provenance,
        turns=turns,
        trained_request_ids=trained,
    )
    return row, removed


def _supersessions(calls: list[Call]) -> dict[int, Call]:
    """Calls abandoned for a resend of the same request: uid -> the resend the client used.

    Among calls sent the same request from the same conversation (siblings, or children of
    indistinguishable twins), each client retry marker says one earlier answer was
    abandoned; so does, after a call (not the first of a conversation: parallel conversations
    may open alike), a later sibling the client went on with while an earlier one was left.
    Each resend replaces the latest earlier one never continued; the last resend lives.
    Which of two identical answers was the abandoned one cannot be known and does not matter."""
    by_place: dict[tuple[Any, ...], list[Call]] = {}
    for call in calls:
        if call.parent is not None:
            place: tuple[Any, ...] = (call.parent.conv_digest, call.request_digest)
        else:
            # Not keyed by the spawning tool call: twin sub-agents are told apart by no more
            # than the retry marker, which pairs with the latest earlier uncontinued answer.
            place = (None, call.request_digest)
        by_place.setdefault(place, []).append(call)
    sets = [g for g in by_place.values() if len(g) > 1]
    out: dict[int, Call] = {}
    for siblings in sets:
        siblings.sort(key=lambda c: c.started)
        consumed: set[int] = set()
        for k, resend in enumerate(siblings):
            continued = bool(resend.children) and resend.parent is not None
            if not (resend.client_retry or continued):
                continue
            # The latest earlier answer left uncontinued is the one this resend replaced; one
            # written already (idle flush) keeps the flag it was written with.
            for earlier in reversed(siblings[:k]):
                if earlier.children or earlier.uid in consumed or earlier.dead:
                    continue
                if not resend.client_retry and earlier.parent is not resend.parent:
                    continue  # a twin conversation that stopped here is not a retry
                consumed.add(earlier.uid)
                if earlier.written_in is None:
                    out[earlier.uid] = resend
                break
    for uid, resend in list(out.items()):
        # Retried again: the last resend is the one that lives.
        while True:
            nxt = out.get(resend.uid) or resend.replaced_by
            if nxt is None:
                break
            resend = nxt
        out[uid] = resend
    for call in calls:
        if call.uid in out:
            call.replaced_by = out[call.uid]
    return out


def _link(
    row: ThreadRow, top: Call, main_child: Any, row_id: Any, superseded: dict[int, Call]
) -> None:
    """Parent link and dead flag of a row whose first trained call is ``top``."""
    parent = top.parent
    resend = superseded.get(top.uid)
    if resend is not None:
        row.dead, row.dead_reason, row.superseded_by = True, "superseded", row_id(resend)
    if parent is not None:
        row.parent_thread_id = row_id(parent)
        row.parent_relation = "continued" if main_child(parent) is top else "branch"
    elif top.parent_row is not None:
        row.parent_thread_id, row.parent_relation = top.parent_row, "continued"
    elif top.spawned_by is not None:
        row.parent_thread_id = row_id(top.spawned_by[0])
        row.parent_relation = "spawn"
        row.parent_tool_call_id = top.spawned_by[1]
    elif top.compaction_of is not None:
        row.parent_thread_id = row_id(top.compaction_of)
        row.parent_relation = "compaction"


def _positional_agreement(a: list[MessageKey], b: list[MessageKey]) -> tuple[int, int]:
    """Non-assistant messages equal at the same position, and, for those that differ, how many
    characters they still share at their start and end (an injected reminder keeps the rest)."""
    equal = similar = 0
    for x, y in zip(a, b, strict=False):
        if x[0] == "assistant":
            continue
        if x == y:
            equal += 1
        elif x[0] == y[0] and isinstance(x[1], str) and isinstance(y[1], str):
            u, v = x[1], y[1]
            n = min(len(u), len(v))
            head = next((i for i in range(n) if u[i] != v[i]), n)
            tail = next((i for i in range(n - head) if u[-1 - i] != v[-1 - i]), n - head)
            similar += head + tail
    return equal, similar


def _align_replies(
    asst: list[int], keys: list[MessageKey], id_calls: dict[int, Call], path: list[Call]
) -> tuple[dict[int, Call], int]:
    """Longest in-order alignment of the request's assistant messages (indices ``asst``) with
    the path's calls. An echoed tool-call id is a match by identity and weighs more than a key.
    Returns message index -> call, and how many of the pairs were matched by id."""
    n, m = len(asst), len(path)
    on_path = {id(c): j for j, c in enumerate(path)}
    # Weighted LCS: id match 1000 + 1, key match 1.
    score = [[0] * (m + 1) for _ in range(n + 1)]
    for a in range(n - 1, -1, -1):
        i = asst[a]
        by_id = id_calls.get(i)
        jid = on_path.get(id(by_id)) if by_id is not None else None
        row, below = score[a], score[a + 1]
        for b in range(m - 1, -1, -1):
            best = max(below[b], row[b + 1])
            if jid == b:
                best = max(best, below[b + 1] + 1001)
            elif jid is None and path[b].conv and path[b].conv[-1] == keys[i]:
                best = max(best, below[b + 1] + 1)
            row[b] = best
    aligned: dict[int, Call] = {}
    id_hits = 0
    a = b = 0
    while a < n and b < m:
        i = asst[a]
        by_id = id_calls.get(i)
        jid = on_path.get(id(by_id)) if by_id is not None else None
        if jid == b and score[a][b] == score[a + 1][b + 1] + 1001:
            aligned[i] = path[b]
            id_hits += 1
            a, b = a + 1, b + 1
        elif (
            jid is None
            and path[b].conv
            and path[b].conv[-1] == keys[i]
            and score[a][b] == score[a + 1][b + 1] + 1
        ):
            aligned[i] = path[b]
            a, b = a + 1, b + 1
        elif score[a][b] == score[a + 1][b]:
            a += 1
        else:
            b += 1
    return aligned, id_hits
