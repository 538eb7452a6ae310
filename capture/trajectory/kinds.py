"""What kind of call made a thread row (its ``thread_kind``): the agent's own conversation
(``main``), a sub-agent's (``subagent``), or a side call whose answer never returns to the
conversation (``auxiliary``: a title, a router's choice of model, a summary).

Decided from what the tree already knows, when the row is written (docs/SHARDS.md, "threads"):

* ``subagent``: the row's calls descend from a conversation a tool call spawned
  (``parent_relation`` ``spawn``), through extensions, retries, rewrites and compactions.
* ``auxiliary``: the row is one call that starts a conversation of its own (no parent, no spawn,
  no compaction link, not the continuation of a row written before), was never continued,
  offered no tools, and the session holds a larger thread that is not a resend of the same
  request: a conversation (two calls or more, or tools offered), or, where the call was
  sampled under a JSON schema (the provider hint: Claude Code's title call, Gemini CLI's router
  call), any larger thread sampled freely.
* ``main``: every other row. A session's only thread, a token-level call (whether it offered
  tools is not known), and parallel copies of one request are never auxiliary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from capture.trajectory.keys import MessageKey, Provenance
from capture.trajectory.tree import CallNode

MAIN = "main"
SUBAGENT = "subagent"
AUXILIARY = "auxiliary"
THREAD_KINDS = (MAIN, SUBAGENT, AUXILIARY)


def tools_offered(header: MessageKey) -> bool | None:
    """Whether the request whose header key (``keys.header_key``) this is offered tools; None
    where the header says nothing of tools (a token-level call)."""
    if len(header) == 2 and isinstance(header[0], tuple):
        return bool(header[0])
    return None


def in_subagent(
    parent: CallNode | None,
    spawned_by: tuple[CallNode, str] | None,
    compaction_of: CallNode | None,
) -> bool:
    """Whether a call placed so belongs to a sub-agent: spawned by a tool call, or continuing
    (extension, retry, rewrite, compaction) a call that does."""
    return (
        spawned_by is not None
        or (parent is not None and parent.subagent)
        or (compaction_of is not None and compaction_of.subagent)
    )


@dataclass
class _Tree:
    """A conversation of the session: the calls under one root."""

    digest: int  # the root's request digest: resends of one request share it
    calls: int = 0
    longest: int = 0  # the longest sequence of its calls
    tools: bool = False  # one of its calls offered tools
    free: bool = False  # one of its calls was sampled without a JSON schema

    @property
    def conversation(self) -> bool:
        return self.calls >= 2 or self.tools


def thread_kinds(leaves: Sequence[CallNode], calls: Sequence[CallNode]) -> list[str]:
    """The ``thread_kind`` of each row, given by the last call of its sequence (``leaves``),
    among all the session's ``calls`` (written ones included). Reads the nodes, changes
    nothing."""
    trees: dict[int, _Tree] | None = None
    root_of: dict[int, CallNode] = {}
    kinds = []
    for leaf in leaves:
        if leaf.subagent:
            kinds.append(SUBAGENT)
            continue
        if not _one_shot(leaf):
            kinds.append(MAIN)
            continue
        if trees is None:
            trees = _trees(calls, root_of)
        kinds.append(AUXILIARY if _beside_larger(leaf, trees) else MAIN)
    return kinds


def thread_kind(leaf: CallNode, calls: Sequence[CallNode]) -> str:
    """The ``thread_kind`` of the row whose sequence ends with ``leaf`` (see
    :func:`thread_kinds`)."""
    return thread_kinds([leaf], calls)[0]


def _one_shot(call: CallNode) -> bool:
    """A call that opened a conversation of its own, was never continued, and offered no tools."""
    return (
        call.parent is None
        and call.parent_row is None
        and call.spawned_by is None
        and call.compaction_of is None
        and not call.children
        and call.tools is False
    )


def _root(call: CallNode, root_of: dict[int, CallNode]) -> CallNode:
    path = []
    node = call
    while node.uid not in root_of and node.parent is not None:
        path.append(node)
        node = node.parent
    root = root_of.get(node.uid, node)
    for n in path:
        root_of[n.uid] = root
    root_of[node.uid] = root
    return root


def _trees(calls: Sequence[CallNode], root_of: dict[int, CallNode]) -> dict[int, _Tree]:
    trees: dict[int, _Tree] = {}
    for call in calls:
        root = _root(call, root_of)
        tree = trees.get(root.uid)
        if tree is None:
            tree = trees[root.uid] = _Tree(root.request_digest)
        tree.calls += 1
        tree.longest = max(tree.longest, call.seq_len)
        tree.tools = tree.tools or bool(call.tools)
        tree.free = tree.free or call.sampled_provenance == Provenance.SAMPLED
    return trees


def _beside_larger(call: CallNode, trees: dict[int, _Tree]) -> bool:
    """Whether the session holds a larger thread than ``call``'s own, not a resend of its
    request: a conversation, or, for a call sampled under a JSON schema, any thread sampled
    freely."""
    constrained = call.sampled_provenance != Provenance.SAMPLED
    size = (1, call.seq_len)
    for uid, tree in trees.items():
        if uid == call.uid or tree.digest == call.request_digest:
            continue
        if (tree.calls, tree.longest) > size and (tree.conversation or (constrained and tree.free)):
            return True
    return False
