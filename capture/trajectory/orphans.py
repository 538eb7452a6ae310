"""A call whose tree is gone by the time it completes: it was placed in its session's tree, and
that tree was written and let go while the call was in flight (its session closed, or the
least recently used of the trees kept for idle sessions dropped). Committed into the session's
tree of now, its nodes would mix with another tree's, whose ``uid`` numbers the same calls
differently: rows would put a span where another call's tokens are. Instead it starts a tree
of its own, its prompt exactly as the policy saw it, the history in it context (never
trained): every call is still trained once, at its own ids."""

from __future__ import annotations

from capture.trajectory.keys import Provenance
from capture.trajectory.placement import ThreadSet
from capture.trajectory.tree import Assembly, CallNode


def placed_in(threads: ThreadSet, assembly: Assembly) -> bool:
    """Whether every call ``assembly`` refers to is a call of ``threads`` (a call's ``uid`` is
    its index in ``threads.calls``)."""
    calls = threads.calls
    refs: list[CallNode | None] = [
        assembly.parent,
        assembly.sibling_of,
        assembly.compaction_of,
        assembly.spawned_by[0] if assembly.spawned_by is not None else None,
        *(call for call, _, _ in assembly.spliced),
    ]
    return all(
        node.uid < len(calls) and calls[node.uid] is node for node in refs if node is not None
    )


def as_new_tree(assembly: Assembly) -> Assembly:
    """``assembly`` as the first call of a tree of its own: the same prompt ids, everything its
    parent's sequence held now context (logprob 0, never trained), its own suffix as it was."""
    held = assembly.base
    return Assembly(
        parent=None,
        prompt_ids=assembly.prompt_ids,
        base=0,
        suffix_logprobs=[0.0] * held + list(assembly.suffix_logprobs),
        suffix_provenance=[int(Provenance.PROMPT)] * held + list(assembly.suffix_provenance),
        keys=assembly.keys,
        header=assembly.header,
        kind="new",
        started=assembly.started,
        client_retry=assembly.client_retry,
        recompute_version=assembly.recompute_version,
    )
