"""A call's place in its session's tree as a journal line, and back: the session journal holds
one per completed call, so a session's tree can be rebuilt from its journal alone after a crash."""

from __future__ import annotations

from typing import Any

from capture.storage.records import TurnRecord
from capture.trajectory.keys import Provenance
from capture.trajectory.kinds import in_subagent
from capture.trajectory.tree import CallNode


def call_entry(call: CallNode) -> dict[str, Any]:
    """A call's place in its session's tree, as a journal line holds it."""
    parent = call.parent
    return {
        "parent": parent.request_id if parent else None,
        # Calls written before the session went idle are not in this journal: their row.
        "parent_row": parent.written_in if parent else None,
        "kind": call.kind,
        "base": call.base,
        "suffix_logprobs": call.suffix_logprobs,
        "suffix_provenance": call.suffix_provenance,
        "spliced": [[c.request_id, start, end] for c, start, end in call.spliced],
        "spawned_by": (
            [call.spawned_by[0].request_id, call.spawned_by[1], call.spawned_by[0].written_in]
            if call.spawned_by
            else None
        ),
        "compaction_of": call.compaction_of.request_id if call.compaction_of else None,
        "retry_of": call.retry_of.request_id if call.retry_of else None,
        "request_digest": call.request_digest,
        "conv_digest": call.conv_digest,
        "started": call.started,
        "client_retry": call.client_retry,
        "sampled_provenance": call.sampled_provenance,
        # What its row's thread_kind is decided from (the spawning call may be written already).
        "tools": call.tools,
        "subagent": call.subagent,
        # The logprobs the thread trains, where they are not the turn record's (a re-score).
        "sampled_logprobs": (
            call.sampled_logprobs if call.sampled_provenance != Provenance.SAMPLED else None
        ),
        # Which weights gave them, where not the turn record's (a re-score's), and the weights
        # that re-scored its suffix.
        "sampled_versions": (
            [list(span) for span in call.sampled_versions]
            if call.sampled_provenance != Provenance.SAMPLED
            else None
        ),
        "suffix_version": call.suffix_version,
    }


def call_from_entry(
    turn: TurnRecord, entry: dict[str, Any], calls: dict[str, CallNode]
) -> CallNode:
    """Rebuild a journaled call; its parent is an earlier call of the same journal."""
    parent = calls.get(entry["parent"]) if entry["parent"] else None
    base = entry["base"]
    suffix_lp = entry["suffix_logprobs"]
    suffix_prov = entry["suffix_provenance"]
    spliced = [(calls[r], s, e) for r, s, e in entry["spliced"] if r in calls]
    parent_row = None
    if entry["parent"] and parent is None:
        # Its parent was written before the session idled: that part of the prompt is context.
        n = len(turn.prompt_ids) - base
        suffix_lp = [0.0] * base + (suffix_lp if suffix_lp is not None else [0.0] * n)
        suffix_prov = [0] * base + (suffix_prov if suffix_prov is not None else [0] * n)
        base = 0
        parent_row = entry.get("parent_row")
    spawn = entry.get("spawned_by")
    spawned_by = (calls[spawn[0]], spawn[1]) if spawn and spawn[0] in calls else None
    compaction_of = calls.get(entry.get("compaction_of") or "")
    call = CallNode(
        uid=len(calls),
        request_id=turn.request_id,
        turn_index=turn.turn_index,
        finish_reason=turn.finish_reason,
        latency_s=turn.latency_s,
        backend=turn.backend,
        parent=parent,
        kind=entry["kind"],
        prompt_len=len(turn.prompt_ids),
        sampled_ids=turn.completion_ids,
        sampled_logprobs=entry.get("sampled_logprobs") or turn.completion_logprobs,
        sampled_provenance=entry.get("sampled_provenance", int(Provenance.SAMPLED)),
        sampled_versions=[
            (str(v), int(s), int(e)) for v, s, e in entry.get("sampled_versions") or []
        ]
        or [(w["version"], w["start"], w["end"]) for w in turn.weight_versions],
        suffix_version=entry.get("suffix_version"),
        prompt_ids=turn.prompt_ids,
        base=base,
        suffix_logprobs=suffix_lp,
        suffix_provenance=suffix_prov,
        spliced=spliced,
        request_digest=entry.get("request_digest", 0),
        conv_digest=entry.get("conv_digest", 0),
        spawned_by=spawned_by,
        compaction_of=compaction_of,
        # Journals before these keys: tools not known (never auxiliary), sub-agents by the links.
        tools=entry.get("tools"),
        subagent=bool(entry.get("subagent")) or in_subagent(parent, spawned_by, compaction_of),
        parent_row=parent_row,
        started=entry.get("started", len(calls) + 1),
        client_retry=bool(entry.get("client_retry")),
        retry_of=calls.get(entry.get("retry_of") or ""),
    )
    if parent is not None:
        parent.children.append(call)
    return call
