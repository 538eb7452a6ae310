"""Placing a request that continues no call: a new tree, linked to the call that spawned it (a
sub-agent whose first message is a tool call's argument) or whose summary it opens with."""

from __future__ import annotations

from capture.trajectory.keys import MessageKey, Provenance
from capture.trajectory.state import MIN_SPAWN_PROMPT, MIN_SUMMARY_CHARS, ThreadState
from capture.trajectory.tree import Assembly, CallNode
from rewriter.canonical import Message, ToolSpec


class NewThreadPlacement(ThreadState):
    def _new_thread(
        self,
        messages: list[Message],
        tools: list[ToolSpec],
        keys: list[MessageKey],
        header: MessageKey,
        enable_thinking: bool | None,
        client_retry: bool = False,
    ) -> Assembly:
        first_user = next((m.content.strip() for m in messages if m.role == "user"), None)
        spawn = self._spawned_by(first_user, client_retry) if first_user else None
        if spawn is not None:
            # Taken now, not at commit: a parallel twin sub-agent takes the next spawning call.
            self._spawns_taken.add((spawn[0].uid, spawn[1]))
        compaction = None if spawn else self._compaction_of(messages, header)
        ids = self.renderer.encode(
            self.renderer.render_text(
                messages, tools or None, add_generation_prompt=True, enable_thinking=enable_thinking
            )
        )
        return Assembly(
            parent=None,
            prompt_ids=ids,
            base=0,
            suffix_logprobs=[0.0] * len(ids),
            suffix_provenance=[int(Provenance.PROMPT)] * len(ids),
            keys=keys,
            header=header,
            kind="new",
            spawned_by=spawn,
            compaction_of=compaction,
        )

    def _untaken_spawn(self, messages: list[Message]) -> bool:
        first_user = next((m.content.strip() for m in messages if m.role == "user"), None)
        spawn = self._spawned_by(first_user) if first_user else None
        return spawn is not None and (spawn[0].uid, spawn[1]) not in self._spawns_taken

    def _spawned_by(self, first_user: str, retry: bool = False) -> tuple[CallNode, str] | None:
        """The (call, tool call) whose string argument opened this conversation.

        Exact match first; else the longest argument the first user message ends with, since
        scaffolds put context blocks (Claude Code: a ``<system-reminder>``) before the prompt.
        """
        options = self._spawn_index.get(first_user)
        if options is None:
            best: str | None = None
            for value in self._spawn_index:
                if len(value) >= MIN_SPAWN_PROMPT and first_user.endswith(value):
                    if best is None or len(value) > len(best):
                        best = value
            if best is None:
                return None
            options = self._spawn_index[best]
        taken = [o for o in options if (o[0].uid, o[1]) in self._spawns_taken]
        if retry and taken:
            return taken[-1]  # a retry repeats the sub-agent's own first request
        for call, tool_id in options:
            if (call.uid, tool_id) not in self._spawns_taken:
                return call, tool_id
        return options[-1]

    def _compaction_of(self, messages: list[Message], header: MessageKey) -> CallNode | None:
        """The call whose long reply (a summary) this new conversation's user text holds."""
        if not self._summaries:
            return None
        text = " ".join(" ".join(m.content.split()) for m in messages if m.role == "user")
        if len(text) < MIN_SUMMARY_CHARS:
            return None
        for call, probes in reversed(self._summaries):
            if sum(1 for p in probes if p in text) >= max(2, len(probes) - 1):
                return call
        return None
