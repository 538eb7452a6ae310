"""A rewritten history whose kept reply the client changed: OpenCode's compaction sends its
summary back merged into the next assistant message, which still echoes the tool-call id of a
policy call. The message is rendered as the client sent it (the policy sees the summary), not
replaced by that call's sampled ids, and the call is trained where it was sampled."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rewriter.canonical import Message
from rewriter.template import ChatTemplate
from tests.unit.trajectory.test_thread_kind import Client, hermes, tool

TOOLS = [tool("read", "Read a file", "filePath"), tool("bash", "Run a command", "command")]
SYSTEM = "You are OpenCode, the best coding agent on the planet."
SUMMARY = "## Objective\n- Replace beta with gamma in notes.txt."


@pytest.fixture(scope="module")
def template(qwen3_dir: Path) -> ChatTemplate:
    return ChatTemplate(qwen3_dir)


def test_a_reply_sent_back_with_text_merged_in_is_rendered_as_sent(
    template: ChatTemplate,
) -> None:
    client = Client(template)
    msgs = [Message("system", SYSTEM), Message("user", "Read big.txt, then edit notes.txt")]
    read, reply = client.call(msgs, hermes("read", {"filePath": "big.txt"}), TOOLS)
    msgs += [reply, Message("tool", "lots of lines", tool_call_id=reply.tool_calls[0].id)]
    bash, reply = client.call(msgs, hermes("bash", {"command": "wc -l notes.txt"}), TOOLS)
    kept = dataclasses.replace(reply, content=SUMMARY)  # the same tool call, its id echoed
    compacted = [
        Message("system", SYSTEM),
        Message("user", "What did we do so far?"),
        kept,
        Message("tool", "2 notes.txt", tool_call_id=reply.tool_calls[0].id),
        Message("user", "Continue if you have next steps."),
    ]
    assembly = client.threads.assemble(compacted, TOOLS, None)
    assert assembly.kind == "rewrite" and assembly.parent is bash
    assert SUMMARY in template.decode(assembly.prompt_ids)
    assert assembly.spliced == []  # nothing of it is the call's sampled ids any more
    after, _ = client.call(compacted, "Done.", TOOLS)
    rows, _ = client.threads.export()
    where = {rid: r for r in rows for rid in r.trained_request_ids}
    assert where[after.request_id].parent_relation is None
    assert {where[c.request_id].parent_relation for c in (read, bash)} == {"rewritten"}
