"""What every placement step shares: a session's calls and their indexes, and the limits."""

from __future__ import annotations

from capture.trajectory.keys import MessageKey, Renderer
from capture.trajectory.tree import CallNode

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
REPLY_PLACEHOLDER = "\u0000AGENTTAP_REPLY_{}\u0000"
DUMMY_USER = "\u0000AGENTTAP_DUMMY_USER\u0000"
DUMMY_REPLY = "\u0000AGENTTAP_DUMMY_REPLY\u0000"


class ThreadState:
    """The calls of one session (a forest) and the indexes that place a new request among them.
    The steps that place a request (``placement``, ``rewrites``, ``new_threads``) and commit it
    (``commits``) extend it."""

    def __init__(self, session_id: str, renderer: Renderer, recompute: bool = True) -> None:
        self.session_id = session_id
        self.renderer = renderer
        self.recompute = recompute
        self.calls: list[CallNode] = []
        self._by_reply: dict[MessageKey, list[CallNode]] = {}
        self._by_tool_id: dict[str, CallNode] = {}
        # Calls by how their conversation ends, so that placing a request compares it with the
        # few calls it could extend or repeat, not with every call of a long session that
        # shares a reply text ("Done.", the same tool call): (reply, the message before it,
        # length) and (length, the request's last message).
        self._by_reply_at: dict[tuple[MessageKey, MessageKey | None, int], list[CallNode]] = {}
        self._by_request_end: dict[tuple[int, MessageKey | None], list[CallNode]] = {}
        # String values of tool-call arguments the policy produced: a sub-agent's first user
        # message equal to one of them was spawned by that call. Several calls may share a value
        # (two sub-agents given the same task): each spawn takes the first one not yet taken.
        self._spawn_index: dict[str, list[tuple[CallNode, str]]] = {}
        self._spawns_taken: set[tuple[int, str]] = set()
        # Long replies (summaries): probes of their text -> call.
        self._summaries: list[tuple[CallNode, list[str]]] = []
        self._claims = 0
        # Message and header keys of this session's recorded calls, each object kept once.
        self._interned: dict[MessageKey, MessageKey] = {}
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

    def _path_id_score(
        self, call: CallNode, id_calls: dict[int, CallNode], path: list[CallNode] | None = None
    ) -> int:
        """How many of the calls the request's echoed ids name lie on ``call``'s path
        (``path``: its ancestors, where the caller has them already)."""
        if not id_calls:
            return 0
        on_path = set(map(id, path if path is not None else call.ancestors()))
        return sum(1 for c in id_calls.values() if id(c) in on_path)
