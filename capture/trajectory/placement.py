"""Placing each request in its session's tree (extension, retry; rewrites and new trees in their
own modules, committing a completed call and the session's rows in ``commits``), and claims on
in-flight calls."""

from __future__ import annotations

import time

from capture.trajectory.commits import CallCommits
from capture.trajectory.export import seq_ids
from capture.trajectory.keys import (
    MessageKey,
    Provenance,
    header_key,
    message_key,
)
from capture.trajectory.new_threads import NewThreadPlacement
from capture.trajectory.rewrites import RewritePlacement
from capture.trajectory.state import (
    CLAIM_TTL_S,
    DUMMY_REPLY,
    DUMMY_USER,
)
from capture.trajectory.tree import Assembly, CallNode
from rewriter.canonical import Message, ToolSpec

# The header key of token-level calls: no message-level request ever matches it.
TOKENS_HEADER = ("tokens",)


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


class ThreadSet(RewritePlacement, NewThreadPlacement, CallCommits):
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
