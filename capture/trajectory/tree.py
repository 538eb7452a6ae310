"""The call tree's nodes: a completed policy call (:class:`CallNode`) and the prompt assembled for
one on its way to the policy (:class:`Assembly`), which becomes a node once the call completes."""

from __future__ import annotations

from dataclasses import dataclass, field

from capture.trajectory.keys import MessageKey, Provenance


@dataclass(eq=False)
class CallNode:
    """One completed policy call, as a node of its session's tree."""

    uid: int  # completion order within the session
    request_id: str
    turn_index: int
    finish_reason: str
    latency_s: float
    backend: str
    parent: CallNode | None
    kind: str  # "new" / "extend" / "rewrite" (a retry repeats its sibling's kind)
    prompt_len: int
    sampled_ids: list[int]
    sampled_logprobs: list[float]
    # Its own prompt + sampled ids; released (None) once an extension child holds them as its
    # prompt's prefix, so a long conversation keeps one copy of its tokens, not one per call.
    prompt_ids: list[int] | None
    # prompt_ids[:base] are the parent's sequence unchanged; the rest is new in this call, with
    # these logprobs and provenance (None: all template/scaffold text, logprob 0).
    base: int
    suffix_logprobs: list[float] | None
    suffix_provenance: list[int] | None
    # Rewrite: earlier calls of the path whose sampled ids sit in prompt_ids[start:end].
    spliced: list[tuple[CallNode, int, int]] = field(default_factory=list)
    # SAMPLED; RECOMPUTED or STALE for a schema-constrained completion (see ThreadSet.commit).
    sampled_provenance: int = Provenance.SAMPLED
    # Which weights gave the sampled tokens' logprobs: (version, start, end) over sampled_ids
    # (the sampler's; a re-score's where sampled_provenance says so); empty: not known.
    sampled_versions: list[tuple[str, int, int]] = field(default_factory=list)
    # The weights that re-scored the suffix's RECOMPUTED tokens (None: none were).
    suffix_version: str | None = None
    # crc32 chains over the header and message keys: of the request, and of the request plus
    # the reply. Calls with one request after calls with one conversation are resends of each
    # other, even where the earlier calls are indistinguishable twins.
    request_digest: int = 0
    conv_digest: int = 0
    spawned_by: tuple[CallNode, str] | None = None  # (call, tool-call id) whose argument opened it
    compaction_of: CallNode | None = None  # the call whose summary this conversation opens with
    # Whether its request offered tools (None: not known, a token-level call), and whether it
    # belongs to a sub-agent (kinds.in_subagent): what a row's thread_kind is decided from.
    tools: bool | None = None
    subagent: bool = False
    children: list[CallNode] = field(default_factory=list)
    # Matching state (live sessions only; not needed to export rows).
    header: MessageKey = ()
    conv: list[MessageKey] = field(default_factory=list)  # request keys + reply key
    tool_ids: frozenset[str] = frozenset()  # minted ids the client echoes: tool calls, replies
    claims: dict[int, float] = field(default_factory=dict)  # in-flight requests extending it
    written_in: str | None = None  # thread id of the row it was trained in, once written
    dead: bool = False  # written in a dead row
    replaced_by: CallNode | None = None  # dead: the resend the client went on with
    started: int = 0  # arrival order of its request (a retry arrives after what it retries)
    client_retry: bool = False  # its client marked the request as a retry
    # Recovered from a journal whose earlier calls were written already: the row it continues.
    parent_row: str | None = None
    # The answer with no visible output (no text, no tool call) whose request this call's
    # request repeats with text appended (Claude Code's "[Your previous response had no visible
    # output...]"): that answer is a dead end, its row marked so (export: "empty", "retry").
    retry_of: CallNode | None = None

    @property
    def seq_len(self) -> int:
        return self.prompt_len + len(self.sampled_ids)

    def ancestors(self) -> list[CallNode]:
        """Root first, this call last."""
        path: list[CallNode] = []
        node: CallNode | None = self
        while node is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path


@dataclass
class Assembly:
    """The prompt for one call, and where the call goes in the tree once it completes."""

    parent: CallNode | None
    prompt_ids: list[int]
    # prompt_ids[:base] are the parent's sequence as it is; the rest is new.
    base: int
    suffix_logprobs: list[float]
    suffix_provenance: list[int]
    keys: list[MessageKey]
    header: MessageKey
    kind: str  # "new" / "extend" / "retry" / "rewrite"
    divergence: int | None = None  # first token that differs from the parent's sequence
    spliced: list[tuple[CallNode, int, int]] = field(default_factory=list)
    spawned_by: tuple[CallNode, str] | None = None
    compaction_of: CallNode | None = None
    claim: int = 0
    started: int = 0  # order in which the session's requests arrived
    client_retry: bool = False
    # A retry: the earlier call with this very request (its prompt is reused as it is).
    sibling_of: CallNode | None = None
    # The weights the RECOMPUTED positions were re-scored by (set with the re-score).
    recompute_version: str | None = None

    def needs_recompute(self) -> list[int]:
        """Positions (in prompt_ids) whose logprobs must be re-scored."""
        if Provenance.RECOMPUTED not in self.suffix_provenance:  # most calls: a C-level scan
            return []
        return [
            self.base + i
            for i, p in enumerate(self.suffix_provenance)
            if p == Provenance.RECOMPUTED
        ]
