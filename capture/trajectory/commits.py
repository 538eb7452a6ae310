"""Committing a completed call to its session's tree (its place, its keys shared with its
parent, the indexes that place later requests, spawn and summary probes), releasing a call that
will not complete, and exporting the session's rows."""

from __future__ import annotations

from capture.trajectory.export import ThreadRow, export_rows
from capture.trajectory.keys import MessageKey, Provenance, fold_keys, message_key
from capture.trajectory.kinds import in_subagent, tools_offered
from capture.trajectory.state import (
    MAX_SPAWN_VALUES,
    MIN_SUMMARY_CHARS,
    SUMMARY_PROBES,
    ThreadState,
)
from capture.trajectory.tree import Assembly, CallNode
from rewriter.canonical import Message

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


class CallCommits(ThreadState):
    """The end of a placed call: committed into the tree where its assembly placed it (and
    indexed for the requests after it), or released; and the rows of the committed calls."""

    def _intern(self, key: MessageKey) -> MessageKey:
        try:
            return self._interned.setdefault(key, key)
        except TypeError:  # unhashable (see _assemble): kept as it is
            return key

    def release(self, assembly: Assembly) -> None:
        """The call will not complete (policy error, client gone): drop its claim."""
        if assembly.parent is not None:
            assembly.parent.claims.pop(assembly.claim, None)

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
