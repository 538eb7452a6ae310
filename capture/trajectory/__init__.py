"""Token-exact trajectories: every policy call is a node in a tree; training rows are its paths.

Pure core: plain dataclasses and functions over token ids and canonical messages; no HTTP, no
mitmproxy, no vLLM. Outside it: a renderer (``rewriter.template.ChatTemplate``), and the call
record a journal line carries (``capture.storage.records.TurnRecord``, in ``journal``).

A *call* (:class:`CallNode`) is one completed policy request: the exact prompt ids vLLM saw and
the ids it sampled. Calls form a tree per session: a call's parent is the earlier call whose
conversation its prompt continues. When a scaffold sends its next request, its history holds
the assistant messages we returned, re-serialized (reasoning dropped, tool-call arguments
re-encoded, ids maybe renamed). The request is placed in the tree, strongest evidence first:

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
all live. An answer with no visible output whose request the client sends again with text appended
(Claude Code's "[Your previous response had no visible output...]") is such a dead end too
(``retry_of``: its row's ``dead_reason`` ``empty``, ``parent_relation`` ``retry``). A call the
client's later history removed (a rewrite that dropped turns) is trained in
a ``rewritten`` row of the sequence it was removed from.

Modules, one concern each: ``keys`` (message keys, digests, provenance), ``tree`` (the nodes:
:class:`CallNode`, :class:`Assembly`), ``state`` (a session's calls and indexes, limits),
``placement`` (:class:`ThreadSet`: extension, retry, claims), ``rewrites`` and
``new_threads`` (the other two ways a request is placed), ``commits`` (a completed call
committed to the tree, a claim released, the session's rows), ``export`` (rows), ``kinds`` (a
row's ``thread_kind``: main, subagent, auxiliary), ``journal`` (a node as a journal line and
back), ``orphans`` (a call whose tree was let go while it was in flight)."""

from __future__ import annotations

from capture.trajectory.export import ThreadRow, export_rows, seq_ids
from capture.trajectory.keys import (
    TRAINED,
    MessageKey,
    Provenance,
    Renderer,
    header_key,
    message_key,
)
from capture.trajectory.kinds import (
    AUXILIARY,
    MAIN,
    SUBAGENT,
    THREAD_KINDS,
    thread_kind,
    thread_kinds,
)
from capture.trajectory.placement import NotInline, ThreadSet
from capture.trajectory.state import CLAIM_TTL_S
from capture.trajectory.tree import Assembly, CallNode

__all__ = [
    "AUXILIARY",
    "CLAIM_TTL_S",
    "MAIN",
    "SUBAGENT",
    "THREAD_KINDS",
    "TRAINED",
    "Assembly",
    "CallNode",
    "MessageKey",
    "NotInline",
    "Provenance",
    "Renderer",
    "ThreadRow",
    "ThreadSet",
    "export_rows",
    "header_key",
    "message_key",
    "seq_ids",
    "thread_kind",
    "thread_kinds",
]

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "rewriter.canonical",  # messages, tools
    "capture.storage.records",  # the call record a journal line carries
)
