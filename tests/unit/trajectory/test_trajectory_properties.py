"""Property tests of the trajectory core (no HTTP, no vLLM): random multi-turn conversations with
random tool calls, re-serialized arguments, renamed ids, injections into earlier turns and
sub-agent threads, assembled with the real Qwen3 chat template."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture.trajectory import CallNode, Provenance, ThreadSet, seq_ids
from rewriter.canonical import AssistantReply, Message, ToolCall, ToolSpec
from rewriter.parsers import parse_completion
from rewriter.template import ChatTemplate

TOOLS = [
    ToolSpec(
        "bash", "Run a command", {"type": "object", "properties": {"cmd": {"type": "string"}}}
    ),
    ToolSpec(
        "agent",
        "Spawn a sub-agent",
        {"type": "object", "properties": {"prompt": {"type": "string"}}},
    ),
]
WORDS = ["alpha", "beta", "files", "done", "ok", "result", "x = 1", "naïve", "日本", "{json}"]


@pytest.fixture(scope="module")
def template(qwen3_dir) -> ChatTemplate:  # type: ignore[no-untyped-def]
    return ChatTemplate(qwen3_dir)


class Policy:
    """Samples replies as token ids, like vLLM would: text, reasoning, hermes tool calls."""

    def __init__(self, template: ChatTemplate, rng: random.Random) -> None:
        self.t, self.rng, self.n = template, rng, 0

    def reply(self, spawn: bool) -> tuple[list[int], list[float], str]:
        rng = self.rng
        text = ""
        if rng.random() < 0.3:
            text += "<think>\n" + " ".join(rng.choices(WORDS, k=3)) + "\n</think>\n\n"
        kind = rng.random()
        if spawn:
            prompt = f"Investigate subsystem {self.n} " + " ".join(rng.choices(WORDS, k=3))
            text += (
                "<tool_call>\n"
                + json.dumps({"name": "agent", "arguments": {"prompt": prompt}})
                + "\n</tool_call>"
            )
        elif kind < 0.5:
            args = {
                "cmd": "ls " + rng.choice(WORDS),
                "n": rng.randint(0, 99),
                "flag": rng.random() < 0.5,
            }
            text += (
                "<tool_call>\n" + json.dumps({"name": "bash", "arguments": args}) + "\n</tool_call>"
            )
        else:
            text += " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))
        self.n += 1
        ids = self.t.encode(text)
        if rng.random() < 0.8:
            ids.append(self.t.eos_token_id)  # stopped by EOS; else cut by the length budget
        return ids, [-(i % 7) / 3.0 - 0.01 for i in range(len(ids))], text


def echo(reply_text: str, rng: random.Random) -> Message:
    """The assistant message as a scaffold sends it back: reasoning dropped, arguments
    re-serialized (key order, spacing), tool-call ids renamed."""
    parsed = parse_completion(reply_text)
    calls = []
    for c in parsed.tool_calls:
        args = json.loads(c.arguments)
        items = list(args.items())
        rng.shuffle(items)
        sep = rng.choice([(",", ":"), (", ", ": ")])
        calls.append(
            ToolCall(
                "toolu_" + str(rng.randint(0, 10**9)),
                c.name,
                json.dumps(dict(items), separators=sep),
            )
        )
    content = parsed.content if rng.random() < 0.5 else " " + parsed.content + "\n"
    return Message("assistant", content, tool_calls=tuple(calls))


def maybe_rewrite(rng: random.Random, msgs: list[Message]) -> None:
    """Now and then inject a reminder into an earlier user turn (a rewrite of history)."""
    if rng.random() < 0.2 and len(msgs) > 3:
        users = [i for i, m in enumerate(msgs[:-1]) if m.role == "user"]
        i = rng.choice(users)
        msgs[i] = Message("user", "<system-reminder>r</system-reminder>\n" + msgs[i].content)


def go_on(
    rng: random.Random,
    msgs: list[Message],
    convs: list[list[Message]],
    text: str,
    parsed: AssistantReply,
) -> list[tuple[int, str]]:
    """The scaffold's side after a reply (``text``, as recorded: ``parsed``): the reply echoed
    into ``msgs``, then its tool results or the next user message; a new conversation in
    ``convs`` per ``agent`` call. Returns the (conversation index, recorded tool-call id) of
    each sub-agent spawned."""
    reply = echo(text, rng)
    msgs.append(reply)
    spawned = []
    if parsed.tool_calls:
        for call, sent in zip(parsed.tool_calls, reply.tool_calls, strict=True):
            msgs.append(Message("tool", "output " + rng.choice(WORDS), tool_call_id=sent.id))
            if call.name == "agent":
                prompt = json.loads(call.arguments)["prompt"]
                convs.append([Message("system", "Sub-agent."), Message("user", prompt)])
                spawned.append((len(convs) - 1, call.id))
    else:
        msgs.append(Message("user", "Next: " + rng.choice(WORDS)))
    return spawned


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(2, 9))
def test_threads_hold_exactly_what_the_policy_saw(
    template: ChatTemplate, seed: int, steps: int
) -> None:
    rng = random.Random(seed)
    policy = Policy(template, rng)
    threads = ThreadSet("s", template)
    convs: list[list[Message]] = [
        [Message("system", "Main agent."), Message("user", "Start the task.")]
    ]
    sampled_by_request: dict[str, list[int]] = {}
    seen_by_request: dict[str, list[int]] = {}
    expected_parent: dict[int, tuple[CallNode, str]] = {}
    for step in range(steps):
        c = rng.randrange(len(convs))
        msgs = convs[c]
        maybe_rewrite(rng, msgs)
        assembly = threads.assemble(msgs, TOOLS, None)
        spawn = c == 0 and rng.random() < 0.3
        ids, lps, text = policy.reply(spawn)
        rid = f"r{step}"
        parsed = parse_completion(text)
        call = threads.commit(
            assembly, parsed.as_message(), ids, lps, request_id=rid, turn_index=step,
            finish_reason="stop", latency_s=0.0, backend="b",
        )  # fmt: skip
        sampled_by_request[rid] = ids
        seen_by_request[rid] = assembly.prompt_ids
        # What vLLM saw plus what it sampled is exactly the call's sequence.
        assert seq_ids(call) == assembly.prompt_ids + ids
        if c in expected_parent:
            assert call.spawned_by == expected_parent.pop(c)
        for spawned, tool_call_id in go_on(rng, msgs, convs, text, parsed):
            expected_parent[spawned] = (call, tool_call_id)

    rows, thread_of = threads.export()
    # No call lost or duplicated: each is trained in exactly one row.
    trained = [rid for row in rows for rid in row.trained_request_ids]
    assert sorted(trained) == sorted(sampled_by_request)
    for row in rows:
        assert len(row.input_ids) == len(row.loss_mask) == len(row.logprobs) == len(row.provenance)
        for i, m in enumerate(row.loss_mask):
            if m:
                assert row.provenance[i] in (Provenance.SAMPLED, Provenance.RECOMPUTED)
        mine = [t for t in row.turns if t["status"] == "trained"]
        for t in row.turns:
            if not t["dropped"]:
                assert row.input_ids[t["start"] : t["end"]] == sampled_by_request[t["request_id"]]
        for t in mine:
            assert thread_of[t["request_id"]] == row.thread_id
        # Trained tokens are exactly this row's own calls' sampled tokens.
        assert {i for i, m in enumerate(row.loss_mask) if m} == {
            i for t in mine for i in range(t["start"], t["end"])
        }
        # The row is what its last call saw, plus what it sampled.
        last = row.turns[-1]
        assert seen_by_request[last["request_id"]] == row.input_ids[: last["start"]]


def test_extension_cost_does_not_depend_on_history(template: ChatTemplate) -> None:
    """Extension renders only the new messages: a mock renderer counts what it is given."""
    threads = ThreadSet("s", template)
    msgs = [Message("system", "s"), Message("user", "u0")]
    rendered: list[int] = []
    real = template.render_text

    def counting(messages, tools=None, **kw):  # type: ignore[no-untyped-def]
        rendered.append(len(messages))
        return real(messages, tools, **kw)

    template.render_text = counting  # type: ignore[method-assign]
    try:
        for i in range(30):
            a = threads.assemble(msgs, [], None)
            ids = template.encode(f"reply {i}") + [template.eos_token_id]
            threads.commit(a, Message("assistant", f"reply {i}"), ids, [-1.0] * len(ids),
                           request_id=str(i), turn_index=i, finish_reason="stop", latency_s=0, backend="b")  # fmt: skip
            msgs += [Message("assistant", f"reply {i}"), Message("user", f"u{i + 1}")]
    finally:
        del template.render_text
    # After the first call each prompt renders 2 dummy messages + 1 new user message.
    assert rendered[1:] == [3] * 29


def test_reply_keys_ignore_whitespace_between_text_blocks() -> None:
    """Text around a tool call comes back from an Anthropic client as separate blocks; joined,
    its whitespace differs from the parsed reply's, and it is still the same reply."""
    from capture.trajectory import message_key
    from rewriter.canonical import Message, ToolCall

    call = (ToolCall("toolu_1", "bash", '{"cmd": "ls"}'),)
    parsed = Message("assistant", "Let me look.  Then answer.", tool_calls=call)
    echoed = Message("assistant", "Let me look.\n\nThen answer.", tool_calls=call)
    assert message_key(parsed) == message_key(echoed)
    assert message_key(parsed) != message_key(Message("assistant", "Let me look.", tool_calls=call))


def _assembly_view(assembly):  # type: ignore[no-untyped-def]
    parent = assembly.parent.uid if assembly.parent is not None else None
    return (assembly.kind, parent, assembly.base, assembly.prompt_ids, assembly.suffix_provenance)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(2, 9),
    budget=st.sampled_from([0, 8, 64, 4096]),
)
def test_inline_assembly_is_the_assembly_or_changes_nothing(
    template: ChatTemplate, seed: int, steps: int, budget: int
) -> None:
    """Two sessions get the same requests and replies: one is always assembled whole, the other
    tries an inline assembly first. The inline one either gives the very same assembly or raises
    NotInline having changed nothing; the trees and their rows end up identical."""
    from capture.trajectory import NotInline

    rng = random.Random(seed)
    policy = Policy(template, rng)
    plain, inline = ThreadSet("s", template), ThreadSet("s", template)
    convs = [[Message("system", "Main agent."), Message("user", "Start the task.")]]
    kinds = []
    for step in range(steps):
        c = rng.randrange(len(convs))
        msgs = convs[c]
        maybe_rewrite(rng, msgs)
        if rng.random() < 0.15:
            msgs = list(msgs)  # sent again: a retry (or a fan-out) of the same request
        expected = plain.assemble(msgs, TOOLS, None)
        claims = inline._claims
        try:
            got = inline.assemble(msgs, TOOLS, None, inline_budget=budget)
            kinds.append(got.kind)
        except NotInline:
            assert inline._claims == claims
            got = inline.assemble(msgs, TOOLS, None)
        assert _assembly_view(got) == _assembly_view(expected)
        ids, lps, text = policy.reply(spawn=c == 0 and rng.random() < 0.3)
        parsed = parse_completion(text)
        for threads, assembly in ((plain, expected), (inline, got)):
            threads.commit(
                assembly, parsed.as_message(), ids, lps, request_id=f"r{step}", turn_index=step,
                finish_reason="stop", latency_s=0.0, backend="b",
            )  # fmt: skip
        go_on(rng, msgs, convs, text, parsed)
    assert "new" not in kinds  # a new tree renders everything: never inline
    if budget == 0:
        assert not [k for k in kinds if k != "retry"]  # nothing new rendered, nothing inline
    rows_plain, threads_plain = plain.export()
    rows_inline, threads_inline = inline.export()
    assert threads_inline == threads_plain
    assert [(r.input_ids, r.loss_mask, r.logprobs) for r in rows_inline] == [
        (r.input_ids, r.loss_mask, r.logprobs) for r in rows_plain
    ]


def test_an_agents_next_call_is_assembled_inline(template: ChatTemplate) -> None:
    """The common case takes the inline path: each call extends the last with a short message;
    a long tool result does not (it is tokenized in a worker thread instead)."""
    from capture.trajectory import NotInline

    threads = ThreadSet("s", template)
    msgs = [Message("system", "s"), Message("user", "u0")]
    for i in range(5):
        if i == 0:
            with pytest.raises(NotInline):
                threads.assemble(msgs, [], None, inline_budget=4096)  # a new tree
            a = threads.assemble(msgs, [], None)
        else:
            a = threads.assemble(msgs, [], None, inline_budget=4096)
            assert a.kind == "extend"
        ids = template.encode(f"reply {i}") + [template.eos_token_id]
        threads.commit(a, Message("assistant", f"reply {i}"), ids, [-1.0] * len(ids),
                       request_id=str(i), turn_index=i, finish_reason="stop", latency_s=0, backend="b")  # fmt: skip
        msgs += [Message("assistant", f"reply {i}"), Message("user", f"u{i + 1}")]
    long_result = msgs + [Message("user", "x " * 4096)]
    with pytest.raises(NotInline, match="4096 characters"):
        threads.assemble(long_result[:-2] + long_result[-1:], [], None, inline_budget=4096)


schema_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(a=st.dictionaries(st.text(max_size=3), schema_values, max_size=4),
       b=st.dictionaries(st.text(max_size=3), schema_values, max_size=4))  # fmt: skip
def test_tool_headers_are_equal_exactly_when_their_schemas_are(
    a: dict[str, object], b: dict[str, object]
) -> None:
    """Two requests' tools are "the same" exactly when their schemas are the same JSON (keys in
    any order; 1, 1.0 and true apart), however the header key writes them."""
    from capture.trajectory import header_key

    same_json = json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    ha = header_key([ToolSpec("t", "d", a)], None)
    assert (ha == header_key([ToolSpec("t", "d", b)], None)) == same_json
    assert ha == header_key([ToolSpec("t", "d", dict(reversed(list(a.items()))))], None)


def test_keys_are_interned_from_recorded_calls_only(template: ChatTemplate) -> None:
    """A recorded call's message keys are the session's objects, which the next request's keys
    become (conversations then compare by identity); a request that is never recorded leaves
    nothing behind (its text is not kept alive)."""
    threads = ThreadSet("s", template)
    system = "You are an agent. " * 2000
    msgs = [Message("system", system), Message("user", "u0")]
    a = threads.assemble(msgs, TOOLS, None)
    ids = template.encode("reply") + [template.eos_token_id]
    threads.commit(a, Message("assistant", "reply"), ids, [-1.0] * len(ids), request_id="0",
                   turn_index=0, finish_reason="stop", latency_s=0, backend="b")  # fmt: skip
    before = dict(threads._interned)
    unrecorded = threads.assemble([Message("system", "x" * 10_000), Message("user", "u")], [], None)
    assert threads._interned == before and unrecorded.kind == "new"
    again = [Message("system", "".join(system)), Message("user", "u0"),
             Message("assistant", "reply"), Message("user", "u1")]  # fmt: skip
    b = threads.assemble(again, TOOLS, None)
    assert b.kind == "extend"
    assert b.keys[0] is threads.calls[0].conv[0] and b.header is threads.calls[0].header


def test_an_unhashable_header_value_is_placed_all_the_same(template: ChatTemplate) -> None:
    """A client's chat_template_kwargs may hold any JSON (enable_thinking: a list): its header
    cannot be interned, and the call is assembled, recorded and extended as any other."""
    threads = ThreadSet("s", template)
    odd: Any = ["x", "y"]
    msgs = [Message("system", "s"), Message("user", "u0")]
    for i in range(3):
        a = threads.assemble(msgs, TOOLS, odd)
        assert a.kind == ("new" if i == 0 else "extend")
        ids = template.encode(f"r{i}") + [template.eos_token_id]
        threads.commit(a, Message("assistant", f"r{i}"), ids, [-1.0] * len(ids),
                       request_id=str(i), turn_index=i, finish_reason="stop", latency_s=0,
                       backend="b")  # fmt: skip
        msgs = [*msgs, Message("assistant", f"r{i}"), Message("user", f"u{i + 1}")]
