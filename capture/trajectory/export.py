"""Rows from the tree: a row is the sequence of the last call of a chain of main children, and
every call is trained in exactly one row (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capture.trajectory.keys import TRAINED, MessageKey, Provenance
from capture.trajectory.kinds import MAIN, thread_kinds
from capture.trajectory.tree import CallNode

# A dead row's reason where it is an answer with no visible output its client asked again for:
# trainers leave it out (capture.storage.reader.to_rl_batch).
DEAD_EMPTY = "empty"


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
    # "rewritten" (calls the client's later history removed from the parent row's conversation),
    # "retry" (a dead end: an answer with no visible output, hung off the row of the request
    # that asked again).
    parent_relation: str | None = None
    parent_tool_call_id: str | None = None
    dead: bool = False
    # "superseded": the same request was sent again; "empty": an answer with no visible output
    # that the client asked again for, with text appended (the retry's row is the rollout's).
    dead_reason: str | None = None
    superseded_by: str | None = None  # this thread id's answer is the one the client went on with
    trained_request_ids: list[str] = field(default_factory=list)
    # "main", "subagent" or "auxiliary" (a side call: title, router, summary); see kinds.
    thread_kind: str = MAIN
    # Which weights gave the policy's tokens their logprobs: {version, start, end} over
    # positions in input_ids (sampled tokens: the sampler's; re-scored ones: the re-score's).
    weight_versions: list[dict[str, Any]] = field(default_factory=list)


def seq_ids(call: CallNode) -> list[int]:
    """A call's whole sequence: its prompt ids + sampled ids (a new list)."""
    if call.prompt_ids is not None:
        return call.prompt_ids + call.sampled_ids
    # Released: an extension descendant's prompt starts with exactly this sequence.
    node = call
    while node.prompt_ids is None:
        node = next(c for c in node.children if c.kind == "extend" and c.base == node.seq_len)
    return node.prompt_ids[: call.seq_len]


def export_rows(calls: list[CallNode]) -> tuple[list[ThreadRow], dict[str, str]]:
    """The rows for every call not yet written (``written_in`` is None).

    Each such call is trained in exactly one row: the one its main children lead to (``loss_mask``
    1 on its sampled tokens there), or, where the client's later history removed it, in a
    ``rewritten`` row of the sequence it was removed from. A call abandoned for a resend is never
    a main child: it ends a dead row of its own."""
    superseded = _supersessions(calls)
    retried = {c.retry_of.uid for c in calls if c.retry_of is not None}

    def main_child(call: CallNode) -> CallNode | None:
        # The continuation a trainer should see: a continued child before one that was not,
        # then the last sent (the retry whose answer the client used).
        live = [c for c in call.children if c.uid not in superseded]
        return max(live, key=lambda c: (bool(c.children), c.started, c.uid)) if live else None

    end_cache: dict[int, CallNode] = {}

    def end_of(call: CallNode) -> CallNode:
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

    def row_id(call: CallNode) -> str:
        return call.written_in or "t-" + end_of(call).request_id

    assigned: dict[int, list[CallNode]] = {}
    for call in calls:
        if call.written_in is None:
            assigned.setdefault(end_of(call).uid, []).append(call)
    by_uid = {c.uid: c for c in calls}
    rows: list[ThreadRow] = []
    leaves: list[CallNode] = []  # the last call of each row's sequence
    thread_of: dict[str, str] = {}
    for end_uid in sorted(assigned):
        end = by_uid[end_uid]
        mine = {c.uid for c in assigned[end_uid]}
        tid = "t-" + end.request_id
        row, removed = _compose(end, mine, tid, row_id)
        top = min(assigned[end_uid], key=lambda c: c.uid)
        _link(row, top, main_child, row_id, superseded, retried)
        rows.append(row)
        leaves.append(end)
        for c in assigned[end_uid]:
            thread_of[c.request_id] = tid
        # Calls the client's later history removed: trained in the sequence they were cut from.
        for cut_at, cut in removed:
            side_id = f"{tid}/r{cut_at.uid}"
            side, _ = _compose(cut_at, {c.uid for c in cut}, side_id, row_id)
            side.parent_thread_id, side.parent_relation = tid, "rewritten"
            rows.append(side)
            leaves.append(cut_at)
            for c in cut:
                thread_of[c.request_id] = side_id
            for turn in row.turns:
                if turn["request_id"] in side.trained_request_ids:
                    turn["trained_in"] = side_id
    for row, kind in zip(rows, thread_kinds(leaves, calls), strict=True):
        row.thread_kind = kind
    return rows, thread_of


def _compose(
    leaf: CallNode, mine: set[int], thread_id: str, row_id: Any
) -> tuple[ThreadRow, list[tuple[CallNode, list[CallNode]]]]:
    """The row of ``leaf``'s sequence training the calls in ``mine``; and, per rewrite that
    removed some of them, (the call before it, the removed calls)."""
    path = leaf.ancestors()
    logprobs: list[float] = []
    provenance: list[int] = []
    # Per position: the weights its logprob came from (None: not the policy's, or not known).
    versions: list[str | None] = []
    spans: dict[int, tuple[int, int] | None] = {}
    cut_at: dict[int, CallNode] = {}  # uid -> the call after which a rewrite removed it
    for call in path:
        base = call.base
        del logprobs[base:]
        del provenance[base:]
        del versions[base:]
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
        versions += _suffix_versions(call, n)
        start = len(logprobs)
        logprobs += call.sampled_logprobs
        provenance += [int(call.sampled_provenance)] * len(call.sampled_ids)
        versions += _labels(call.sampled_versions, len(call.sampled_ids))
        spans[call.uid] = (start, len(logprobs))
    ids = seq_ids(leaf)
    assert len(ids) == len(logprobs) == len(provenance), "a call's deltas do not compose"
    removed: list[tuple[CallNode, list[CallNode]]] = []
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
        weight_versions=_version_spans(versions),
    )
    return row, removed


def _labels(spans: list[tuple[str, int, int]], n: int) -> list[str | None]:
    """Per token of a call's ``n`` sampled tokens, the version its spans give it."""
    labels: list[str | None] = [None] * n
    for version, start, end in spans:
        labels[max(0, start) : min(n, end)] = [version] * (min(n, end) - max(0, start))
    return labels


def _suffix_versions(call: CallNode, n: int) -> list[str | None]:
    """Per position of a call's new prompt suffix: the sampled tokens a rewrite spliced in keep
    their sampler's version; the ones it re-scored, the re-score's."""
    labels: list[str | None] = [None] * n
    if call.suffix_provenance is None:
        return labels
    for spliced, start, end in call.spliced:
        if start >= call.base:
            own = _labels(spliced.sampled_versions, len(spliced.sampled_ids))
            at = start - call.base
            labels[at : at + (end - start)] = own[: end - start]
    if call.suffix_version is not None:
        for i, p in enumerate(call.suffix_provenance):
            if p == Provenance.RECOMPUTED:
                labels[i] = call.suffix_version
    return labels


def _version_spans(versions: list[str | None]) -> list[dict[str, Any]]:
    """Runs of one version (None: no span) as {version, start, end}."""
    out: list[dict[str, Any]] = []
    run_start = 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[run_start]:
            if versions[run_start] is not None:
                out.append({"version": versions[run_start], "start": run_start, "end": i})
            run_start = i
    return out


def _supersessions(calls: list[CallNode]) -> dict[int, CallNode]:
    """Calls abandoned for a resend of the same request: uid -> the resend the client used.

    Among calls sent the same request from the same conversation (siblings, or children of
    indistinguishable twins), each client retry marker says one earlier answer was
    abandoned; so does, after a call (not the first of a conversation: parallel conversations
    may open alike), a later sibling the client went on with while an earlier one was left.
    Each resend replaces the latest earlier one never continued; the last resend lives.
    Which of two identical answers was the abandoned one cannot be known and does not matter."""
    by_place: dict[tuple[Any, ...], list[CallNode]] = {}
    for call in calls:
        if call.parent is not None:
            place: tuple[Any, ...] = (call.parent.conv_digest, call.request_digest)
        else:
            # Not keyed by the spawning tool call: twin sub-agents are told apart by no more
            # than the retry marker, which pairs with the latest earlier uncontinued answer.
            place = (None, call.request_digest)
        by_place.setdefault(place, []).append(call)
    sets = [g for g in by_place.values() if len(g) > 1]
    out: dict[int, CallNode] = {}
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
    for call in calls:
        # An answer with no visible output, asked again with text appended: a dead end.
        empty = call.retry_of
        if empty is not None and empty.written_in is None and empty.uid not in out:
            out[empty.uid] = call
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
    row: ThreadRow,
    top: CallNode,
    main_child: Any,
    row_id: Any,
    superseded: dict[int, CallNode],
    retried: set[int],
) -> None:
    """Parent link and dead flag of a row whose first trained call is ``top``."""
    parent = top.parent
    resend = superseded.get(top.uid)
    if resend is not None:
        row.dead, row.dead_reason, row.superseded_by = True, "superseded", row_id(resend)
        if top.uid in retried:
            # The answer nobody saw: hung off the row the client's new request went on in.
            row.dead_reason = DEAD_EMPTY
            row.parent_thread_id, row.parent_relation = row_id(resend), "retry"
            return
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


def positional_agreement(a: list[MessageKey], b: list[MessageKey]) -> tuple[int, int]:
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


def align_replies(
    asst: list[int], keys: list[MessageKey], id_calls: dict[int, CallNode], path: list[CallNode]
) -> tuple[dict[int, CallNode], int]:
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
    aligned: dict[int, CallNode] = {}
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
