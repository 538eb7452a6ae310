"""Placing a request whose history holds our replies but is not an extension (a scaffold
rewrote an old turn): its owner is the call whose replies align best, and the conversation is
rendered whole with each aligned reply spliced in as its exact sampled ids."""

from __future__ import annotations

from capture.trajectory.export import align_replies, positional_agreement, seq_ids
from capture.trajectory.keys import MessageKey, Provenance, common_prefix_len
from capture.trajectory.state import MAX_REWRITE_CANDIDATES, REPLY_PLACEHOLDER, ThreadState
from capture.trajectory.tree import Assembly, CallNode
from rewriter.canonical import Message, ToolSpec


class RewritePlacement(ThreadState):
    def _rewrite_owner(
        self,
        messages: list[Message],
        keys: list[MessageKey],
        header: MessageKey,
        id_calls: dict[int, CallNode],
    ) -> tuple[CallNode, dict[int, CallNode]] | None:
        """The call whose path of replies the request's history aligns with best, and which
        request message (index) is which call's reply."""
        asst = [i for i, k in enumerate(keys) if k[0] == "assistant"]
        if not asst:
            return None
        cands: dict[int, CallNode] = {}
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

        def prescore(c: CallNode) -> tuple[int, int, int]:
            # Echoed ids first: with many calls sharing a reply text ("Done.", the same tool
            # call), the cut below must never drop the call the client's ids name.
            path = c.ancestors()
            on_path = sum(1 for a in path if a.conv and a.conv[-1] in asst_keys)
            return (self._path_id_score(c, id_calls, path), on_path, c.uid)

        ranked = sorted(cands.values(), key=prescore, reverse=True)[:MAX_REWRITE_CANDIDATES]
        best: tuple[tuple[int, ...], CallNode, dict[int, CallNode]] | None = None
        for c in ranked:
            path = c.ancestors()
            aligned, id_hits = align_replies(asst, keys, id_calls, path)
            if not aligned:
                continue
            holds_all = len(aligned) == len(path)
            positional, similar = positional_agreement(keys, c.conv)
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
                shown.append(Message("assistant", REPLY_PLACEHOLDER.format(len(order))))
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
            before, _, rest = rest.partition(REPLY_PLACEHOLDER.format(k))
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
        owner: CallNode,
        aligned: dict[int, CallNode],
        messages: list[Message],
        tools: list[ToolSpec],
        keys: list[MessageKey],
        header: MessageKey,
        enable_thinking: bool | None,
    ) -> Assembly:
        # A reply the client sent back changed (text merged into it: OpenCode puts its compaction
        # summary into the next assistant message, found by its echoed tool-call id) is rendered
        # as sent; splicing the sampled ids would hide the added text from the policy.
        aligned = {i: c for i, c in aligned.items() if c.conv and c.conv[-1] == keys[i]}
        splice = {i: call.sampled_ids for i, call in aligned.items()}
        ids, spans = self.render_spliced(messages, tools, splice, enable_thinking)
        p = common_prefix_len(ids, seq_ids(owner))
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
