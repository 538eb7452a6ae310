"""Placing each request in its session's tree (extension, retry; rewrites and new trees in their
own modules), claims on in-flight calls, committing a completed call, and the session's rows."""

from __future__ import annotations

import time

from capture.trajectory.export import ThreadRow, export_rows, seq_ids
from capture.trajectory.keys import (
    MessageKey,
    Provenance,
    fold_keys,
    header_key,
    message_key,
)
from capture.trajectory.kinds import in_subagent, tools_offered
from capture.trajectory.new_threads import NewThreadPlacement
from capture.trajectory.rewrites import RewritePlacement
from capture.trajectory.state import (
    CLAIM_TTL_S,
    DUMMY_REPLY,
    DUMMY_USER,
    MAX_SPAWN_VALUES,
    MIN_SUMMARY_CHARS,
    SUMMARY_PROBES,
)
from capture.trajectory.tree import Assembly, CallNode
from rewriter.canonical import Message, ToolSpec

# The header key of token-level calls: no message-level request ever matches it.
TOKENS_HEADER = ("tokens",)
# The key of an answer with no visible output: no text (whitespace aside), no tool call.
EMPTY_REPLY: MessageKey = ("assistant", "", ())


def appends_to(old: list[MessageKey], new: list[MessageKey]) -> bool:
    """Whether the request ``new`` is the request ``old`` with text appended: at most one
    non-assistant message's text extended, and messages other than assistant ones added at the
    end (how a scaffold asks again after an answer with no visible output)."""
    if len(new) < len(old):
        return False
    changed = 0
    for a, b in zip(old, new, strict=False):
        if a == b:
            continue
        if a[0] == "assistant" or a[0] != b[0] or len(a) != 2 or len(b) != 2:
            return False
        if not (isinstance(a[1], str) and isinstance(b[1], str) and b[1].startswith(a[1])):
            return False
        changed += 1
        if changed > 1:
            return False
    added = new[len(old) :]
    return not any(k[0] == "assistant" for k in added) and changed + len(added) > 0


class NotInline(Exception):
    """An inline assembly (``assemble(inline_budget=...)``) would render more than its budget,
    or a whole conversation (a rewrite, a new tree): nothing was changed; assemble it again
    without a budget (in a worker thread, where tokenizing lets other sessions run)."""


def message_chars(messages: list[Message]) -> int:
    """About how much text rendering ``messages`` tokenizes (its characters)."""
    total = 0
    for m in messages:
        total += len(m.content) + len(m.reasoning or "")
        for call in m.tool_calls:
            total += len(call.name) + len(call.arguments)
    return total


class ThreadSet(RewritePlacement, NewThreadPlacement):
    """The calls of one session (a forest), the assembly of each prompt, and its rows."""

    # -- assembly ---------------------------------------------------------------------------
    def assemble(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        enable_thinking: bool | None,
        client_retry: bool = False,
        inline_budget: int | None = None,
    ) -> Assembly:
        """Where a request goes in the tree, and its prompt ids. ``client_retry``: the client
        says this request is a retry of one it sent before (its SDK's retry counter).
        ``inline_budget``: only an extension whose new messages hold at most this many
        characters, or a retry (nothing rendered), is assembled; anything else raises
        NotInline before any state changes. An agent's next call is almost always such an
        extension, cheap enough to place on the event loop without a worker thread's hop."""
        assembly = self._assemble(messages, tools, enable_thinking, client_retry, inline_budget)
        assembly.client_retry = client_retry
        return assembly

    def assemble_tokens(self, token_ids: list[int]) -> Assembly:
        """Where a call made of token ids (the white-box ``generate``) goes: an extension of the
        call whose whole sequence (prompt + sampled ids) its ids start with, the longest such,
        so a multi-turn token-level agent's calls form one thread; else a new tree. Its ids
        are the prompt as they are: nothing is rendered."""
        parent = None
        for call in sorted(self.calls, key=lambda c: c.seq_len, reverse=True):
            if call.seq_len <= len(token_ids) and seq_ids(call) == token_ids[: call.seq_len]:
                parent = call
                break
        base = parent.seq_len if parent is not None else 0
        suffix = len(token_ids) - base
        return self._claim(
            Assembly(
                parent=parent,
                prompt_ids=list(token_ids),
                base=base,
                suffix_logprobs=[0.0] * suffix,
                suffix_provenance=[int(Provenance.PROMPT)] * suffix,
                keys=[],
                header=TOKENS_HEADER,
                kind="extend" if parent is not None else "new",
            )
        )

    def _assemble(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        enable_thinking: bool | None,
        client_retry: bool,
        inline_budget: int | None = None,
    ) -> Assembly:
        inline = inline_budget is not None
        # The session's own key objects where it has equal ones (commit interns them): then a
        # candidate call's conversation compares with the request's by identity, not by the
        # text of every message (a 20,000-token system prompt) per candidate.
        interned = self._interned.get
        keys = [message_key(m) for m in messages]
        header = header_key(tools, enable_thinking)
        try:
            keys = [interned(k, k) for k in keys]
            header = interned(header, header)
        except TypeError:
            pass  # an unhashable value from the client (a list for enable_thinking): as it is
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
                if inline:
                    raise NotInline("a rewrite renders the whole conversation")
                call, aligned = owner
                return self._claim(
                    self._rewrite(call, aligned, messages, tools, keys, header, enable_thinking)
                )
        # A request its client marks as a retry goes beside the call it repeats, if there is one.
        sibling = self._answered(keys, header, id_calls) if client_retry else None
        if sibling is None and parent is not None and not self._busy(parent):
            return self._claim(
                self._extend(parent, messages, keys, header, enable_thinking, inline_budget)
            )
        if sibling is None:
            sibling = self._answered(keys, header, id_calls)
        if sibling is not None and sibling.parent is None and self._untaken_spawn(messages):
            sibling = None  # the same task given to another sub-agent, not a retry
        if sibling is not None:
            return self._claim(self._retry(sibling, keys))
        if parent is not None:  # fan-out: a second continuation of the same call
            return self._claim(
                self._extend(parent, messages, keys, header, enable_thinking, inline_budget)
            )
        if inline:
            raise NotInline("a rewrite or a new tree renders the whole conversation")
        owner = self._rewrite_owner(messages, keys, header, id_calls)
        if owner is not None:
            call, aligned = owner
            return self._claim(
                self._rewrite(call, aligned, messages, tools, keys, header, enable_thinking)
            )
        return self._claim(
            self._new_thread(messages, tools, keys, header, enable_thinking, client_retry)
        )

    def _intern(self, key: MessageKey) -> MessageKey:
        try:
            return self._interned.setdefault(key, key)
        except TypeError:  # unhashable (see _assemble): kept as it is
            return key

    def _id_evidence(self, messages: list[Message]) -> dict[int, CallNode]:
        """Message index -> the call whose minted ids that assistant message echoes: its
        tool-call ids, or the reply ids a provider keeps on the message (a Responses API
        response named by its items' ids)."""
        found: dict[int, CallNode] = {}
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
        self, parent: CallNode, keys: list[MessageKey], id_calls: dict[int, CallNode]
    ) -> bool:
        """Whether the messages after ``parent``'s conversation hold a reply of one of its
        continuations (an earlier turn was edited): then the request is a rewrite."""
        for i in range(len(parent.conv), len(keys)):
            if keys[i][0] != "assistant":
                continue
            if i in id_calls or any(c.conv[-1] == keys[i] for c in parent.children):
                return True
        return False

    def _busy(self, call: CallNode) -> bool:
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

    def _consistent(self, cands: list[CallNode], id_calls: dict[int, CallNode]) -> list[CallNode]:
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
        id_calls: dict[int, CallNode],
        client_retry: bool = False,
    ) -> CallNode | None:
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
                # The index's key holds the length: every call found has n messages.
                for c in self._by_reply_at.get((key, keys[i - 1] if i else None, n), ())
                if c.header == header
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
        self, keys: list[MessageKey], header: MessageKey, id_calls: dict[int, CallNode]
    ) -> CallNode | None:
        """The latest call that was sent this very request (so this one is a retry)."""
        if not keys or keys[-1][0] == "assistant":
            return None
        pool = self._by_request_end.get((len(keys) + 1, keys[-1]), [])
        cands = [
            c
            for c in pool
            if c.header == header and c.prompt_ids is not None and c.conv[:-1] == keys
        ]
        cands = self._consistent(cands, id_calls)
        if not cands:
            return None
        return max(cands, key=lambda c: (self._path_id_score(c, id_calls), c.uid))

    def _closing_ids(self, call: CallNode) -> list[int]:
        """The template's closing tokens after the call's reply."""
        sampled = call.sampled_ids
        if sampled and self._tail_ids and sampled[-1] == self._tail_ids[0]:
            return self._tail_ids[1:]  # the reply ended with the template's own end token
        return list(self._tail_ids)

    def render_delta(self, new: list[Message], enable_thinking: bool | None) -> list[int]:
        """Ids of ``new`` messages as the template renders them after an assistant turn,
        plus the generation prompt; costs time proportional to ``new`` only."""
        dummy = [Message("user", DUMMY_USER), Message("assistant", DUMMY_REPLY)]
        text = self.renderer.render_text(
            dummy + new, None, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        cut = text.index(DUMMY_REPLY) + len(DUMMY_REPLY)
        if not text.startswith(self._tail_text, cut):
            raise ValueError("chat template closes assistant turns inconsistently")
        return self.renderer.encode(text[cut + len(self._tail_text) :])

    def _extend(
        self,
        parent: CallNode,
        messages: list[Message],
        keys: list[MessageKey],
        header: MessageKey,
        enable_thinking: bool | None,
        inline_budget: int | None = None,
    ) -> Assembly:
        """``parent``'s sequence + its closing tokens + the new messages rendered; NotInline,
        before anything is rendered, where those hold more than ``inline_budget`` characters."""
        new = messages[len(parent.conv) :]
        if inline_budget is not None and message_chars(new) > inline_budget:
            raise NotInline(f"the new messages hold more than {inline_budget} characters")
        suffix = self._closing_ids(parent) + self.render_delta(new, enable_thinking)
        prompt = seq_ids(parent)  # a new list: extended in place, not copied again
        base = len(prompt)
        prompt.extend(suffix)
        return Assembly(
            parent=parent,
            prompt_ids=prompt,
            base=base,
            suffix_logprobs=[0.0] * len(suffix),
            suffix_provenance=[int(Provenance.PROMPT)] * len(suffix),
            keys=keys,
            header=header,
            kind="extend",
        )

    def _retry(self, sibling: CallNode, keys: list[MessageKey]) -> Assembly:
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
        sampled_versions: list[tuple[str, int, int]] | None = None,
    ) -> CallNode:
        """Add a completed call to the tree, where its assembly placed it.

        ``sampled_provenance``: RECOMPUTED where ``sampled_logprobs`` are a re-score rather than
        the sampler's (a completion constrained by a JSON schema: the sampler's logprobs are
        the constrained distribution's), STALE where no re-score could be had (masked).
        ``sampled_versions``: which weights gave ``sampled_logprobs`` ((version, start, end)
        over ``sampled_ids``)."""
        self.release(assembly)
        # Keys of recorded calls only: a request that never completes keeps no text alive.
        intern = self._intern
        parent = assembly.parent
        if assembly.kind == "retry" and assembly.sibling_of is not None:
            kind = assembly.sibling_of.kind
        else:
            kind = assembly.kind
        prompt = assembly.prompt_ids
        provenance = assembly.suffix_provenance
        # list.count: a new thread's suffix is its whole prompt (tens of thousands of entries).
        all_prompt = provenance.count(Provenance.PROMPT) == len(provenance)
        call = CallNode(
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
            sampled_versions=list(sampled_versions or ()),
            suffix_version=None if all_prompt else assembly.recompute_version,
            prompt_ids=prompt,
            base=assembly.base,
            suffix_logprobs=None if all_prompt else list(assembly.suffix_logprobs),
            suffix_provenance=None if all_prompt else [int(p) for p in provenance],
            spliced=list(assembly.spliced),
            spawned_by=assembly.spawned_by,
            compaction_of=assembly.compaction_of,
            tools=tools_offered(assembly.header),
            subagent=in_subagent(parent, assembly.spawned_by, assembly.compaction_of),
            header=intern(assembly.header),
            started=assembly.started or len(self.calls) + 1,
            client_retry=assembly.client_retry,
            tool_ids=frozenset([*(c.id for c in reply.tool_calls if c.id), *reply.ids]),
        )
        reply_key = intern(message_key(reply))
        keys = assembly.keys
        if kind == "extend" and parent is not None:
            # Share the parent's key tuples (and the text in them): a long conversation holds
            # each message's text once, not once per call.
            n = len(parent.conv)
            call.conv = parent.conv + [intern(k) for k in keys[n:]] + [reply_key]
            call.request_digest = fold_keys(parent.conv_digest, keys[n:])
        else:
            call.conv = [intern(k) for k in keys] + [reply_key]
            call.request_digest = fold_keys(fold_keys(0, [assembly.header]), keys)
        call.conv_digest = fold_keys(call.request_digest, [reply_key])
        if kind in ("new", "extend"):
            call.retry_of = self._retried_empty(keys, assembly.header, parent)
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
        before = call.conv[-2] if len(call.conv) > 1 else None
        self._by_reply_at.setdefault((reply_key, before, len(call.conv)), []).append(call)
        self._by_request_end.setdefault((len(call.conv), before), []).append(call)
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

    def _retried_empty(
        self, keys: list[MessageKey], header: MessageKey, parent: CallNode | None
    ) -> CallNode | None:
        """The latest answer with no visible output, in the same place (same parent), not
        continued, written or retried yet, whose request ``keys`` repeat with text appended."""
        for call in reversed(self._by_reply.get(EMPTY_REPLY, ())):
            if (
                call.parent is not parent
                or call.children
                or call.written_in is not None
                or call.header != header
                or not appends_to(call.conv[:-1], keys)
            ):
                continue
            if any(c.retry_of is call for c in self.calls):
                continue
            return call
        return None

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
