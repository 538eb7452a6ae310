"""A thread row's ``thread_kind`` (capture/trajectory/kinds.py): ``main``, ``subagent`` or
``auxiliary``, decided from the session's call tree. Sessions are built in-process as the
gateway would place them (real Qwen3 template), shaped like what each client sends
(../shared/notes/clients.md): Claude Code's title call, Gemini CLI's router call, a summary a
compacted conversation opens with, a sub-agent spawned by a tool call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from capture.storage.records import TurnRecord
from capture.storage.sessions import RowAnnotations, SessionStore
from capture.storage.shards import THREAD_SCHEMA
from capture.trajectory import (
    AUXILIARY,
    MAIN,
    SUBAGENT,
    THREAD_KINDS,
    CallNode,
    Provenance,
    ThreadSet,
    thread_kind,
)
from capture.trajectory.journal import call_entry, call_from_entry
from rewriter.canonical import ChatRequest, Message, ToolSpec
from rewriter.parsers import parse_completion
from rewriter.template import ChatTemplate

DOCS = Path(__file__).resolve().parents[3] / "docs" / "SHARDS.md"


def tool(name: str, description: str, arg: str) -> ToolSpec:
    return ToolSpec(name, description, {"type": "object", "properties": {arg: {"type": "string"}}})


# Claude Code offers its tools on every main call (Agent, Bash, Write, ...); its title call none.
CLAUDE_TOOLS = [
    tool("Agent", "Launch a sub-agent for a task", "prompt"),
    tool("Bash", "Run a shell command", "command"),
    tool("Write", "Write a file", "file_path"),
]
CLAUDE_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude. " * 40
# Gemini CLI: 15 function declarations on its main calls; the router call has none.
GEMINI_TOOLS = [tool(f"tool_{i}", f"Gemini CLI tool {i}", "arg") for i in range(15)]
GEMINI_SYSTEM = "You are an interactive CLI agent specializing in software engineering. " * 30


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def template(qwen3_dir: Path) -> ChatTemplate:
    return ChatTemplate(qwen3_dir)


class Client:
    """A scaffold's calls placed in one session's tree, as the gateway places them."""

    def __init__(self, template: ChatTemplate) -> None:
        self.t = template
        self.threads = ThreadSet("s", template)
        self.n = 0

    def call(
        self,
        messages: list[Message],
        reply: str,
        tools: list[ToolSpec] | None = None,
        constrained: bool = False,
        retry: bool = False,
    ) -> tuple[CallNode, Message]:
        """One call; returns it and its reply as the client sends it back."""
        assembly = self.threads.assemble(messages, tools or [], None, client_retry=retry)
        ids = self.t.encode(reply) + [self.t.eos_token_id]
        parsed = parse_completion(reply).as_message()
        call = self.threads.commit(
            assembly, parsed, ids, [-0.5] * len(ids), request_id=f"r{self.n}",
            turn_index=self.n, finish_reason="stop", latency_s=0.1, backend="b",
            # A JSON-schema answer: trained with re-scored logprobs (ThreadSet.commit).
            sampled_provenance=Provenance.RECOMPUTED if constrained else Provenance.SAMPLED,
        )  # fmt: skip
        self.n += 1
        return call, parsed

    def tokens(self, ids: list[int], reply: list[int]) -> CallNode:
        assembly = self.threads.assemble_tokens(ids)
        call = self.threads.commit(
            assembly, Message("assistant", ""), reply, [-0.5] * len(reply),
            request_id=f"r{self.n}", turn_index=self.n, finish_reason="stop", latency_s=0.1,
            backend="b",
        )  # fmt: skip
        self.n += 1
        return call

    def kinds(self) -> dict[str, str]:
        """Request id -> the thread_kind of the row that trains it (rows written now)."""
        rows, _ = self.threads.export()
        assert all(r.thread_kind in THREAD_KINDS for r in rows)
        return {rid: r.thread_kind for r in rows for rid in r.trained_request_ids}


def claude_main(client: Client, task: str = "Create hello.txt containing hi") -> list[Message]:
    """Claude Code's main conversation: a Write tool call, its result, the final answer."""
    msgs = [
        Message("system", CLAUDE_SYSTEM),
        Message("user", f"<system-reminder>Today is Monday.</system-reminder>\n{task}"),
    ]
    _, reply = client.call(msgs, hermes("Write", {"file_path": "hello.txt"}), CLAUDE_TOOLS)
    msgs += [reply, Message("tool", "File written", tool_call_id=reply.tool_calls[0].id)]
    return msgs


def claude_title(client: Client, task: str = "Create hello.txt containing hi") -> CallNode:
    """Claude Code's title call: a haiku model, ``output_config.format`` a JSON schema, no tools."""
    msgs = [
        Message("system", "Generate a concise, sentence-case title (3-7 words) for the session."),
        Message("user", task),
    ]
    return client.call(msgs, '{"title": "Create hello file"}', constrained=True)[0]


# -- each client's side calls -----------------------------------------------------------------


def test_claude_code_title_call_is_auxiliary(template: ChatTemplate) -> None:
    client = Client(template)
    msgs = claude_main(client)
    title = claude_title(client)  # sent while the main call runs
    client.call(msgs, "Done: hello.txt holds hi.", CLAUDE_TOOLS)
    kinds = client.kinds()
    assert kinds == {"r0": MAIN, "r1": AUXILIARY, "r2": MAIN}
    assert thread_kind(title, client.threads.calls) == AUXILIARY


def test_a_side_call_without_tools_or_schema_is_auxiliary(template: ChatTemplate) -> None:
    """A scaffold's plain side call (a title asked for in free text, an OpenCode-style title
    call with thinking on): one call, no tools, never continued, beside the agent's
    conversation."""
    client = Client(template)
    msgs = claude_main(client)
    client.call(
        [Message("system", "Write a short title for this conversation."), Message("user", "hi")],
        "Weather in Paris",
    )
    client.call(msgs, "Done.", CLAUDE_TOOLS)
    assert client.kinds() == {"r0": MAIN, "r1": AUXILIARY, "r2": MAIN}


def test_gemini_cli_router_call_and_its_retries_are_auxiliary(template: ChatTemplate) -> None:
    """Gemini CLI's router call (``responseJsonSchema``, no functionDeclarations) comes first
    and may be sent again until its answer is valid; then the main calls, with 15 tools."""
    client = Client(template)
    router = [
        Message("system", "You are a router: choose the model for the user's request."),
        Message("user", "Create hello.txt with hi"),
    ]
    answer = '{"reasoning": "simple", "model_choice": "flash"}'
    client.call(router, answer, constrained=True)
    client.call(router, answer, constrained=True, retry=True)  # the first answer: a dead row
    msgs = [Message("system", GEMINI_SYSTEM), Message("user", "Create hello.txt with hi")]
    _, reply = client.call(msgs, hermes("tool_3", {"arg": "hello.txt"}), GEMINI_TOOLS)
    msgs += [reply, Message("tool", "ok", tool_call_id=reply.tool_calls[0].id)]
    client.call(msgs, "Done: hello.txt holds hi.", GEMINI_TOOLS)
    rows, _ = client.threads.export()
    by_kind = {(r.thread_kind, r.dead, len(r.trained_request_ids)) for r in rows}
    assert by_kind == {(AUXILIARY, True, 1), (AUXILIARY, False, 1), (MAIN, False, 2)}


def test_a_summary_is_auxiliary_and_the_compacted_conversation_main(
    template: ChatTemplate,
) -> None:
    client = Client(template)
    msgs = claude_main(client)
    client.call(msgs, "Done.", CLAUDE_TOOLS)
    summary = (
        "Summary of the session so far: the user asked for hello.txt containing hi; the agent "
        "wrote the file with the Write tool and checked its content; nothing else is pending "
        "and no errors were seen; the next step is to run the tests in the repository."
    )
    client.call(
        [Message("system", "Summarize this conversation."), Message("user", "transcript ...")],
        summary,
    )
    compacted = [
        Message("system", CLAUDE_SYSTEM),
        Message("user", f"This session continues an earlier one. {summary} Go on."),
    ]
    after, _ = client.call(compacted, "Running the tests.", CLAUDE_TOOLS)
    assert after.compaction_of is client.threads.calls[2]
    assert client.kinds() == {"r0": MAIN, "r1": MAIN, "r2": AUXILIARY, "r3": MAIN}


def test_a_sub_agent_and_everything_under_it_is_subagent(template: ChatTemplate) -> None:
    client = Client(template)
    msgs = [Message("system", CLAUDE_SYSTEM), Message("user", "Fix the failing test")]
    task = "Investigate why test_foo fails in module foo and report the cause"
    _, reply = client.call(msgs, hermes("Agent", {"prompt": task}), CLAUDE_TOOLS)
    sub = [Message("system", "You are a sub-agent."), Message("user", task)]
    first, sub_reply = client.call(sub, hermes("Bash", {"command": "pytest -x"}), CLAUDE_TOOLS)
    assert first.spawned_by is not None
    sub += [sub_reply, Message("tool", "1 failed", tool_call_id=sub_reply.tool_calls[0].id)]
    client.call(sub, "The cause: foo returns None.", CLAUDE_TOOLS)
    client.call(sub, "Or: foo is not imported.", CLAUDE_TOOLS)  # a parallel branch of it
    msgs += [reply, Message("tool", "The cause: foo", tool_call_id=reply.tool_calls[0].id)]
    client.call(msgs, "Fixed.", CLAUDE_TOOLS)
    rows, _ = client.threads.export()
    kinds = {rid: r.thread_kind for r in rows for rid in r.trained_request_ids}
    assert kinds == {"r0": MAIN, "r1": SUBAGENT, "r2": SUBAGENT, "r3": SUBAGENT, "r4": MAIN}
    relations = {r.parent_relation for r in rows if r.thread_kind == SUBAGENT}
    assert relations == {"spawn", "branch"}


# -- what is never auxiliary ------------------------------------------------------------------


def test_a_sessions_only_thread_is_main(template: ChatTemplate) -> None:
    client = Client(template)
    claude_title(client)  # alone: whatever it looks like, it is the session's work
    assert client.kinds() == {"r0": MAIN}


def test_one_shot_calls_without_a_conversation_are_main(template: ChatTemplate) -> None:
    """Separate one-shot calls (a task of one question each, parallel samples of one request):
    no conversation beside them, so none is a side call."""
    client = Client(template)
    for text in ("first question", "another, much longer question " * 10, "third"):
        client.call([Message("user", text)], "An answer.")
    same = [Message("user", "the same request")]
    client.call(same, "Sample one.")
    client.call(same, "Sample two.")
    assert set(client.kinds().values()) == {MAIN}


def test_a_dead_first_answer_of_the_conversation_is_main(template: ChatTemplate) -> None:
    """An agent without tools (text actions): its first answer abandoned for a resend of the
    same request, which the conversation goes on from. The dead row is the conversation's."""
    client = Client(template)
    msgs = [Message("system", "Act with ```bash blocks."), Message("user", "Fix the test")]
    client.call(msgs, "```bash\nls\n```")
    _, reply = client.call(msgs, "```bash\npytest\n```", retry=True)
    client.call([*msgs, reply, Message("user", "1 failed")], "```bash\ncat foo.py\n```")
    rows, _ = client.threads.export()
    assert [(r.dead, r.thread_kind) for r in rows] == [(True, MAIN), (False, MAIN)]


def test_the_largest_thread_is_not_auxiliary(template: ChatTemplate) -> None:
    """A long one-shot call beside a shorter single call that offered tools: the larger is the
    session's work. Under a JSON schema (the provider hint), a smaller one-shot call beside a
    larger free one is a side call; without the hint it is not."""
    client = Client(template)
    client.call([Message("user", "ok?")], "yes", CLAUDE_TOOLS[:1])
    client.call([Message("user", "Summarize this long document. " * 200)], "It is long.")
    assert client.kinds() == {"r0": MAIN, "r1": MAIN}

    client = Client(template)
    client.call([Message("user", "Write a poem about the sea. " * 20)], "Waves.")
    client.call([Message("user", "Pick a model")], '{"model": "flash"}', constrained=True)
    client.call([Message("user", "Pick a colour")], "Blue")
    assert client.kinds() == {"r0": MAIN, "r1": AUXILIARY, "r2": MAIN}


def test_token_level_calls_are_never_auxiliary(template: ChatTemplate) -> None:
    """White-box ``generate`` calls say nothing of tools: a one-shot one stays main."""
    client = Client(template)
    first = client.tokens([1, 2, 3], [4, 5])
    client.tokens([1, 2, 3, 4, 5, 6], [7])
    client.tokens([9, 9], [8])
    assert first.tools is None
    assert client.kinds() == {"r0": MAIN, "r1": MAIN, "r2": MAIN}


# -- through the store: columns, flushes, recovery ---------------------------------------------


def record(
    store: SessionStore,
    sid: str,
    rid: str,
    messages: list[Message],
    reply: str,
    tools: list[ToolSpec] | None = None,
    constrained: bool = False,
) -> Message:
    template = store.renderer
    assert isinstance(template, ChatTemplate)
    assembly = store.assemble(sid, ChatRequest(messages, "m", tools=tools or []))
    ids = template.encode(reply) + [template.eos_token_id]
    turn = TurnRecord(
        session_id=sid, request_id=rid, turn_index=store.next_turn_index(sid),
        protocol="anthropic.messages", requested_model="m", policy_model="p", backend="b",
        user_agent="claude-cli/2.1", prompt_ids=assembly.prompt_ids, completion_ids=ids,
        completion_logprobs=[-0.25] * len(ids), finish_reason="stop",
        response_finish_reason="end_turn", started_at=0.0, latency_s=0.1, stream=True,
    )  # fmt: skip
    parsed = parse_completion(reply).as_message()
    rescored = [-0.3] * len(ids) if constrained else None
    store.record(turn, assembly, parsed, rescored=rescored, constrained=constrained)
    return parsed


def claude_session(store: SessionStore, sid: str) -> None:
    """Claude Code's main conversation (two calls) and its title call, through the store."""
    msgs = [Message("system", CLAUDE_SYSTEM), Message("user", "Create hello.txt")]
    reply = record(store, sid, "r0", msgs, hermes("Write", {"file_path": "h"}), CLAUDE_TOOLS)
    record(
        store, sid, "r1", [Message("system", "Generate a title."), Message("user", "Create")],
        '{"title": "Hello"}', constrained=True,
    )  # fmt: skip
    msgs += [reply, Message("tool", "ok", tool_call_id=reply.tool_calls[0].id)]
    record(store, sid, "r2", msgs, "Done.", CLAUDE_TOOLS)


def kinds_of(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {rid: r["thread_kind"] for r in rows for rid in r["trained_request_ids"]}


def test_the_column_is_written_and_survives_recovery(
    tmp_path: Path, template: ChatTemplate
) -> None:
    store = SessionStore(tmp_path / "a", template)
    claude_session(store, "s")
    rows: list[dict[str, Any]] = []
    assert kinds_of(store.pending_rows("s")) == {"r0": MAIN, "r1": AUXILIARY, "r2": MAIN}
    store.end_session("s", rows_out=rows)
    assert kinds_of(rows) == {"r0": MAIN, "r1": AUXILIARY, "r2": MAIN}
    table = pq.read_table(tmp_path / "a" / "threads")
    assert table.schema.field("thread_kind").type == THREAD_SCHEMA.field("thread_kind").type
    assert sorted(table.column("thread_kind").to_pylist()) == [AUXILIARY, MAIN]

    # A crash before the session was written: the journal gives the same rows.
    store = SessionStore(tmp_path / "b", template)
    claude_session(store, "s")
    recovered = SessionStore(tmp_path / "b", template)
    recovered.recover()
    table = pq.read_table(tmp_path / "b" / "threads")
    assert kinds_of(table.to_pylist()) == {"r0": MAIN, "r1": AUXILIARY, "r2": MAIN}


def test_a_sub_agent_recovered_after_its_spawner_was_written(
    tmp_path: Path, template: ChatTemplate
) -> None:
    """The spawning call was written at an idle flush; then the proxy crashed during the
    sub-agent. Its journal holds no spawner to link to, and its rows are still subagent."""
    store = SessionStore(tmp_path, template)
    task = "Investigate why test_foo fails in module foo and report the cause"
    msgs = [Message("system", CLAUDE_SYSTEM), Message("user", "Fix it")]
    record(store, "s", "r0", msgs, hermes("Agent", {"prompt": task}), CLAUDE_TOOLS)
    store.end_session("s", keep_threads=True)
    sub = [Message("system", "Sub-agent."), Message("user", task)]
    reply = record(store, "s", "r1", sub, hermes("Bash", {"command": "pytest"}), CLAUDE_TOOLS)
    sub += [reply, Message("tool", "1 failed", tool_call_id=reply.tool_calls[0].id)]
    record(store, "s", "r2", sub, "foo returns None", CLAUDE_TOOLS)
    assert kinds_of(store.pending_rows("s")) == {"r1": SUBAGENT, "r2": SUBAGENT}
    SessionStore(tmp_path, template).recover()
    rows = pq.read_table(tmp_path / "threads").to_pylist()
    assert kinds_of(rows) == {"r0": MAIN, "r1": SUBAGENT, "r2": SUBAGENT}


def test_journal_lines_from_before_the_kinds_are_main(template: ChatTemplate) -> None:
    """A journal written before ``tools`` and ``subagent`` were journaled: tools not known, so
    no call of it is auxiliary; a sub-agent is still one by its spawn link."""
    client = Client(template)
    claude_main(client)
    title = claude_title(client)
    entry = call_entry(title)
    assert entry["tools"] is False and entry["subagent"] is False
    del entry["tools"], entry["subagent"]
    turn = TurnRecord(
        session_id="s", request_id="r1", turn_index=1, protocol="p", requested_model="m",
        policy_model="p", backend="b", user_agent="u", prompt_ids=[1, 2], completion_ids=[3],
        completion_logprobs=[-1.0], finish_reason="stop", response_finish_reason="stop",
        started_at=0.0, latency_s=0.1, stream=False,
    )  # fmt: skip
    old = call_from_entry(turn, entry, {})
    assert old.tools is None and not old.subagent
    assert thread_kind(old, [old, *client.threads.calls[:1]]) == MAIN


# -- rewards at close -------------------------------------------------------------------------


def test_one_reward_skips_auxiliary_rows_unless_asked() -> None:
    rows = [
        {"thread_id": "t-main", "thread_kind": MAIN, "reward": None},
        {"thread_id": "t-sub", "thread_kind": SUBAGENT, "reward": None},
        {"thread_id": "t-title", "thread_kind": AUXILIARY, "reward": None},
        {"thread_id": "t-old", "thread_kind": None, "reward": None},  # before the column
    ]

    def rewards(annotations: RowAnnotations) -> dict[str, float | None]:
        out = [dict(r) for r in rows]
        for row in out:
            annotations.apply(row)
        return {r["thread_id"]: r["reward"] for r in out}

    assert rewards(RowAnnotations(reward=1.0)) == {
        "t-main": 1.0, "t-sub": 1.0, "t-title": None, "t-old": 1.0,
    }  # fmt: skip
    assert set(rewards(RowAnnotations(reward=1.0, reward_auxiliary=True)).values()) == {1.0}
    # A per-thread reward is set where it says, auxiliary rows included.
    assert rewards(RowAnnotations(reward={"t-title": 0.5, "t-main": 1.0})) == {
        "t-main": 1.0, "t-sub": None, "t-title": 0.5, "t-old": None,
    }  # fmt: skip


def test_the_docs_list_the_column_and_its_values() -> None:
    """docs/SHARDS.md's threads table names every column of THREAD_SCHEMA, thread_kind with
    its values."""
    text = DOCS.read_text()
    section = text[text.index("## threads") : text.index("## turns")]
    documented = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            documented.update(n.strip("`") for n in line.split("|")[1].strip().split(", "))
    assert set(THREAD_SCHEMA.names) <= documented, set(THREAD_SCHEMA.names) - documented
    row = next(line for line in section.splitlines() if line.startswith("| `thread_kind`"))
    assert all(f"`{kind}`" in row for kind in THREAD_KINDS)
