"""Conservation, as a property of the pure trajectory core (no HTTP, no vLLM).

Random sessions of several conversations through one ``ThreadSet``, with the real Qwen3 template:
a policy that often repeats the same reply text (and the same tool call), conversations started
with identical prompts (twin sub-agents), requests in flight at once and completed in any order,
scaffold retries of identical requests (before and after the first answer arrived), rewrites of
earlier messages, tool-call ids echoed back or renamed by the scaffold, and idle flushes midway.

Asserted over every row ever exported for the session:
* every call's sampled tokens are trained (loss_mask 1) in exactly one row, at a span holding
  exactly its sampled ids; no token is trained twice; nothing is dropped (these scaffolds never
  remove a reply from the history they continue);
* every row's input_ids are exactly its last call's prompt + sampled ids, and every call it lists
  sits at a span holding that call's sampled ids;
* a retry's abandoned answer is only ever in a row flagged dead, superseded by a live one;
* a continuation is placed after the call its conversation really continues, unless that call
  has an indistinguishable twin (same conversation, no echoed tool-call id to tell them apart).
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture.trajectory import Assembly, CallNode, ThreadRow, ThreadSet, seq_ids
from rewriter.canonical import Message, ToolCall, ToolSpec
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
# Few distinct replies: identical text across conversations is the point.
TEXTS = ["Done.", "ok", "Let me check.", "<think>\nhmm\n</think>\n\nDone."]
CALLS = [
    {"name": "bash", "arguments": {"cmd": "ls"}},
    {"name": "bash", "arguments": {"cmd": "cat a.py", "n": 2}},
]
SPAWN = {
    "name": "agent",
    "arguments": {"prompt": "Investigate the failing test in the parser module."},
}

RUNS: Counter[str] = Counter()


@pytest.fixture(scope="module")
def template(qwen3_dir) -> ChatTemplate:  # type: ignore[no-untyped-def]
    return ChatTemplate(qwen3_dir)


@dataclass
class Conversation:
    messages: list[Message]
    renames_ids: bool
    last: CallNode | None = None  # the call whose answer this conversation went on with
    spawned_by: tuple[int, str] | None = None
    opening: str = ""


@dataclass
class InFlight:
    conv: int
    assembly: Assembly
    request: list[Message]
    retry_of: InFlight | None = None
    expected_parent: CallNode | None = None
    abandoned: bool = False
    call: CallNode | None = field(default=None)


class Session:
    def __init__(self, template: ChatTemplate, rng: random.Random) -> None:
        self.t, self.rng = template, rng
        self.threads = ThreadSet("s", template)
        self.convs: list[Conversation] = []
        self.inflight: list[InFlight] = []
        self.done: list[InFlight] = []
        self.rows: list[ThreadRow] = []
        self.n = 0
        self.flushes = 0
        self.exported_in: dict[str, int] = {}

    # -- the policy and the scaffold -------------------------------------------------------
    def sample(self, spawn: bool) -> tuple[list[int], str]:
        rng = self.rng
        if spawn:
            text = "<tool_call>\n" + json.dumps(SPAWN) + "\n</tool_call>"
        elif rng.random() < 0.5:
            text = "<tool_call>\n" + json.dumps(rng.choice(CALLS)) + "\n</tool_call>"
        else:
            text = rng.choice(TEXTS)
        ids = self.t.encode(text)
        if rng.random() < 0.85:
            ids.append(self.t.eos_token_id)
        return ids, text

    def echo(self, reply: Message, renames: bool) -> Message:
        calls = []
        for c in reply.tool_calls:
            items = list(json.loads(c.arguments).items())
            self.rng.shuffle(items)
            new_id = "toolu_" + str(self.rng.randint(0, 10**9)) if renames else c.id
            calls.append(ToolCall(new_id, c.name, json.dumps(dict(items), separators=(",", ":"))))
        return Message("assistant", " " + reply.content + "\n", tool_calls=tuple(calls))

    # -- actions -----------------------------------------------------------------------------
    def new_conversation(self, user: str, spawned_by: tuple[int, str] | None = None) -> None:
        msgs = [Message("system", "Agent."), Message("user", user)]
        self.convs.append(
            Conversation(
                msgs, renames_ids=self.rng.random() < 0.5, spawned_by=spawned_by, opening=user
            )
        )

    def send(self, c: int) -> None:
        conv = self.convs[c]
        if any(f.conv == c and not f.abandoned for f in self.inflight):
            return
        request = list(conv.messages)
        assembly = self.threads.assemble(request, TOOLS, None)
        self.inflight.append(InFlight(c, assembly, request, expected_parent=conv.last))

    def retry(self, c: int) -> None:
        """The scaffold resends its last request; it goes on with the new answer."""
        live = [f for f in self.inflight if f.conv == c and not f.abandoned]
        done = [
            f for f in self.done if f.conv == c and not f.abandoned and f.call is self.convs[c].last
        ]
        if live:
            first = live[-1]
        elif (
            done
            and done[-1].call is not None
            and not self.convs[c].messages[-1].role == "assistant"
        ):
            return
        else:
            return
        first.abandoned = True
        assembly = self.threads.assemble(list(first.request), TOOLS, None, client_retry=True)
        self.inflight.append(
            InFlight(
                c, assembly, first.request, retry_of=first, expected_parent=first.expected_parent
            )
        )

    def retry_answered(self, c: int) -> None:
        """The scaffold timed out on a call the proxy did answer, and resends it."""
        conv = self.convs[c]
        last = [f for f in self.done if f.conv == c and f.call is conv.last and not f.abandoned]
        if not last or any(f.conv == c and not f.abandoned for f in self.inflight):
            return
        first = last[-1]
        # The client never saw the first answer: roll its history back to the request.
        conv.messages = list(first.request)
        conv.last = first.expected_parent
        first.abandoned = True
        assembly = self.threads.assemble(list(first.request), TOOLS, None, client_retry=True)
        self.inflight.append(
            InFlight(
                c, assembly, first.request, retry_of=first, expected_parent=first.expected_parent
            )
        )

    def complete(self, k: int) -> None:
        f = self.inflight.pop(k)
        spawn = f.conv == 0 and self.rng.random() < 0.25
        ids, text = self.sample(spawn)
        reply = parse_completion(text).as_message()
        self.n += 1
        f.call = self.threads.commit(
            f.assembly, reply, ids, [-(i % 5) / 4.0 - 0.01 for i in range(len(ids))],
            request_id=f"r{self.n}", turn_index=self.n, finish_reason="stop", latency_s=0.0, backend="b",
        )  # fmt: skip
        self.done.append(f)
        if f.abandoned:
            return
        conv = self.convs[f.conv]
        conv.last = f.call
        conv.messages.append(self.echo(reply, conv.renames_ids))
        sent = conv.messages[-1]
        if reply.tool_calls:
            for call, echoed in zip(reply.tool_calls, sent.tool_calls, strict=True):
                conv.messages.append(Message("tool", "output", tool_call_id=echoed.id))
                if call.name == "agent":
                    self.new_conversation(SPAWN["arguments"]["prompt"], (f.call.uid, call.id))
        else:
            conv.messages.append(Message("user", "Next."))

    def rewrite(self, c: int) -> None:
        msgs = self.convs[c].messages
        users = [i for i, m in enumerate(msgs) if m.role in ("user", "tool") and i < len(msgs) - 1]
        if len(msgs) > 3 and users:
            i = self.rng.choice(users)
            m = msgs[i]
            msgs[i] = Message(
                m.role,
                "<system-reminder>r</system-reminder>\n" + m.content,
                tool_call_id=m.tool_call_id,
            )

    def flush(self) -> None:
        rows, thread_of = self.threads.export()
        self.rows += rows
        self.flushes += 1
        for rid in thread_of:
            self.exported_in.setdefault(rid, self.flushes)


def check(session: Session) -> None:
    rows = session.rows
    calls = {c.request_id: c for c in session.threads.calls}
    # An answer written (idle flush) before its retry was cannot be flagged any more.
    exported = session.exported_in
    abandoned = {
        f.retry_of.call.request_id
        for f in session.done
        if f.retry_of is not None
        and f.retry_of.call is not None
        and f.call is not None
        and exported[f.retry_of.call.request_id] >= exported[f.call.request_id]
    }
    trained_in: Counter[str] = Counter()
    total_mask = 0
    by_id = {r.thread_id: r for r in rows}
    assert len(by_id) == len(rows), "thread ids are unique"
    for row in rows:
        total_mask += sum(row.loss_mask)
        leaf = calls[row.turns[-1]["request_id"]]
        # The row is exactly what vLLM saw for its last call, plus what it sampled.
        assert row.input_ids == seq_ids(leaf)
        assert leaf.prompt_ids is None or row.input_ids == leaf.prompt_ids + leaf.sampled_ids
        assert len(row.input_ids) == len(row.loss_mask) == len(row.logprobs) == len(row.provenance)
        mask_positions = set()
        for t in row.turns:
            call = calls[t["request_id"]]
            assert t["status"] != "dropped" and not t["dropped"], "no scaffold here removes a reply"
            assert row.input_ids[t["start"] : t["end"]] == call.sampled_ids
            if t["status"] == "trained":
                trained_in[call.request_id] += 1
                span = range(t["start"], t["end"])
                assert all(row.loss_mask[i] == 1 for i in span)
                # Logprobs: the sampler's, unless re-scored after a rewrite (filled by the caller).
                kept = [row.logprobs[i] for i in span if row.provenance[i] == 1]
                assert kept == [
                    lp
                    for i, lp in zip(span, call.sampled_logprobs, strict=True)
                    if row.provenance[i] == 1
                ]
                mask_positions.update(span)
            else:
                assert t["trained_in"] in by_id and t["trained_in"] != row.thread_id
        assert mask_positions == {i for i, m in enumerate(row.loss_mask) if m}
        if row.dead:
            assert row.dead_reason == "superseded" and len(row.trained_request_ids) == 1
            assert row.superseded_by in by_id and not by_id[row.superseded_by].dead
    # Conservation: every call trained in exactly one row, no token twice.
    assert dict(trained_in) == {rid: 1 for rid in calls}
    assert total_mask == sum(len(c.sampled_ids) for c in calls.values())
    # Placement: a continuation goes after the call its conversation went on with, or after an
    # indistinguishable twin of it.
    for f in session.done:
        assert f.call is not None
        got, want = f.call.parent, f.expected_parent
        if got is want:
            continue
        assert got is not None and want is not None, (f.call.request_id, f.call.kind, got, want)
        request = f.call.conv[:-1]
        # A twin whose conversation is exactly the start of this request (the same text, the
        # same rewrite) is as good a place: nothing tells them apart.
        assert got.conv == want.conv or request[: len(got.conv)] == got.conv, (
            "placed after a call of another conversation"
        )
        renamed = session.convs[f.conv].renames_ids
        assert renamed or not want.tool_ids, "echoed tool-call ids tell twins apart"

    # Dead rows: every abandoned answer is flagged, unless its row was written (idle flush) before
    # its retry was; and nothing the client went on with is. Which of two calls sent the same
    # prompt from the same place (or from twins of it) was the abandoned one cannot be known and
    # does not matter, so this is counted per such set of identical calls.
    abandoned_any = {f.call.request_id for f in session.done if f.abandoned and f.call is not None}
    dead = {r.trained_request_ids[0] for r in rows if r.dead}
    sets: dict[tuple[object, object], set[str]] = {}
    for c in calls.values():
        # The same request after indistinguishable twins (same conversation) is one place.
        place = tuple(c.parent.conv) if c.parent else None
        sets.setdefault((place, tuple(c.conv[:-1])), set()).add(c.request_id)
    # An abandoned answer that a continuation was placed after (its indistinguishable twin's) is
    # the live one now; its twin is the one to flag.
    abandoned = {rid for rid in abandoned if not calls[rid].children}
    # Conversations that open alike (twins) may have their identical calls swapped (the placement
    # check above allows it where no echoed id tells them apart); then which twin's answer gets
    # the flag is not defined, and only conservation is checked.
    openings = [c.opening for c in session.convs]
    if len(set(openings)) < len(openings):
        RUNS["sessions with twin conversations"] += 1
        return
    for members in sets.values():
        assert len(abandoned & members) <= len(dead & members) <= len(abandoned_any & members), (
            members
        )
        RUNS["dead rows checked"] += len(dead & members)


# CI runs a fixed set of examples (derandomized); a developer's run explores new ones.
@settings(
    max_examples=int(os.environ.get("AGENTTAP_PROPERTY_EXAMPLES", "400")),
    derandomize=bool(os.environ.get("CI")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(4, 28), n_conv=st.integers(1, 4))
def test_every_sampled_token_is_trained_exactly_once(
    template: ChatTemplate, seed: int, steps: int, n_conv: int
) -> None:
    rng = random.Random(seed)
    s = Session(template, rng)
    # Conversations opened with identical prompts: their replies will often be identical too.
    for i in range(n_conv):
        s.new_conversation("Fix the bug." if rng.random() < 0.6 else f"Task {i}.")
    for _ in range(steps):
        r = rng.random()
        c = rng.randrange(len(s.convs))
        if r < 0.45:
            s.send(c)
        elif r < 0.55:
            s.retry(c)
        elif r < 0.62:
            s.retry_answered(c)
        elif r < 0.72:
            s.rewrite(c)
        elif r < 0.76 and not s.inflight:
            # (A flush while a retried request is still in flight cannot know yet which of two
            # identical answers will be abandoned: conservation holds, the dead flag may not.)
            s.flush()
            RUNS["flushes"] += 1
        if s.inflight and rng.random() < 0.6:
            s.complete(rng.randrange(len(s.inflight)))
    while s.inflight:
        s.complete(rng.randrange(len(s.inflight)))
    s.flush()
    check(s)
    RUNS["sessions"] += 1
    RUNS["calls"] += len(s.threads.calls)
    RUNS["retries"] += sum(1 for f in s.done if f.retry_of is not None)
    RUNS["rewrites"] += sum(1 for c in s.threads.calls if c.kind == "rewrite")
    RUNS["dead rows"] += sum(1 for r in s.rows if r.dead)
    RUNS["rows"] += len(s.rows)


def test_zz_report_counts() -> None:
    """Prints what the property test ran (pytest -s); runs after it in file order."""
    print("\nconservation property test:", dict(RUNS))
    assert RUNS["sessions"] > 0 or not RUNS


def _one_call(
    threads: ThreadSet,
    msgs: list[Message],
    text: str,
    template: ChatTemplate,
    rid: str,
    retry: bool = False,
) -> CallNode:
    a = threads.assemble(msgs, TOOLS, None, client_retry=retry)
    ids = template.encode(text) + [template.eos_token_id]
    return threads.commit(a, parse_completion(text).as_message(), ids, [-0.5] * len(ids),
                          request_id=rid, turn_index=0, finish_reason="stop", latency_s=0, backend="b")  # fmt: skip


def test_identical_replies_then_a_rewrite_stay_in_their_own_conversation(
    template: ChatTemplate,
) -> None:
    """The defect this core was rebuilt for: two conversations of one session whose replies
    are identical; a later call rewrites the first user message of the second one. It belongs
    to the second conversation; the first keeps its turn; nothing is trained twice."""
    threads = ThreadSet("s", template)
    a = [Message("system", "Agent."), Message("user", "Task A")]
    b = [Message("system", "Agent."), Message("user", "Task B")]
    a1 = _one_call(threads, a, "Done.", template, "a1")
    b1 = _one_call(threads, b, "Done.", template, "b1")
    b += [Message("assistant", "Done."), Message("user", "More")]
    b2 = _one_call(threads, b, "Done.", template, "b2")
    # The scaffold injects a reminder into B's first user message.
    b = [Message("system", "Agent."), Message("user", "<system-reminder>x</system-reminder>Task B"),
         Message("assistant", "Done."), Message("user", "More"), Message("assistant", "Done."), Message("user", "Go on")]  # fmt: skip
    b3 = _one_call(threads, b, "ok", template, "b3")
    assert b3.kind == "rewrite" and b3.parent is b2
    rows, thread_of = threads.export()
    assert thread_of["a1"] != thread_of["b3"]
    row_a = next(r for r in rows if r.thread_id == thread_of["a1"])
    assert row_a.trained_request_ids == ["a1"] and not row_a.dead
    row_b = next(r for r in rows if r.thread_id == thread_of["b3"])
    assert row_b.trained_request_ids == ["b1", "b2", "b3"]
    assert sum(sum(r.loss_mask) for r in rows) == sum(len(c.sampled_ids) for c in (a1, b1, b2, b3))


def test_a_rewrite_goes_where_the_echoed_id_points_among_many_identical_replies(
    template: ChatTemplate,
) -> None:
    """Twenty conversations whose first replies are the same tool call; the oldest one goes on,
    its minted tool-call id echoed, with its first user message rewritten. More calls share
    the reply than the rewrite owner search looks at closely; the echoed id still decides."""
    threads = ThreadSet("s", template)
    call_text = "<tool_call>\n" + json.dumps(CALLS[0]) + "\n</tool_call>"
    firsts = [
        _one_call(
            threads,
            [Message("system", "Agent."), Message("user", f"Task {i}")],
            call_text,
            template,
            f"c{i}",
        )
        for i in range(20)
    ]
    tc = ToolCall(next(iter(firsts[0].tool_ids)), "bash", '{"cmd": "ls"}')
    rewritten = [Message("system", "Agent."), Message("user", "<system-reminder>x</system-reminder>Task 0"),
                 Message("assistant", "", tool_calls=(tc,)), Message("tool", "a.py", tool_call_id=tc.id)]  # fmt: skip
    later = _one_call(threads, rewritten, "Done.", template, "c0-2")
    assert later.kind == "rewrite" and later.parent is firsts[0]
    rows, thread_of = threads.export()
    assert thread_of["c0-2"] == thread_of["c0"]
    assert len({thread_of[f"c{i}"] for i in range(20)}) == 20
    assert sum(sum(r.loss_mask) for r in rows) == sum(len(c.sampled_ids) for c in [*firsts, later])


def test_a_reply_id_decides_between_identical_text_replies(template: ChatTemplate) -> None:
    """Text-only replies carry no tool-call id; a Responses API client sends back item ids that
    name the response (``Message.ids``). Two conversations answered "Done."; the older one goes
    on with its first user message replaced outright (no text left to align on): its reply id
    still puts the rewrite on its own thread, not the newer twin's."""
    threads = ThreadSet("s", template)

    def call(msgs: list[Message], rid: str) -> CallNode:
        a = threads.assemble(msgs, TOOLS, None)
        ids = template.encode("Done.") + [template.eos_token_id]
        reply = Message("assistant", "Done.", ids=(f"resp_{rid}",))
        return threads.commit(a, reply, ids, [-0.5] * len(ids), request_id=rid, turn_index=0, finish_reason="stop", latency_s=0, backend="b")  # fmt: skip

    first = call([Message("system", "Agent."), Message("user", "Task A")], "a1")
    call([Message("system", "Agent."), Message("user", "Task B")], "b1")
    later = call([Message("system", "Agent."), Message("user", "(earlier context compacted)"),
                  Message("assistant", "Done.", ids=("resp_a1",)), Message("user", "More")], "a2")  # fmt: skip
    assert later.kind == "rewrite" and later.parent is first
    _, thread_of = threads.export()
    assert thread_of["a2"] == thread_of["a1"] != thread_of["b1"]


def test_many_conversations_with_the_same_replies_each_extend_and_retry_their_own(
    template: ChatTemplate,
) -> None:
    """One long session: forty tasks of three turns, every reply "Done.", each step's request
    unlike every other task's only in its user messages. Placement looks calls up by how their
    conversation ends (the reply, the message before it); each turn still extends its own
    task's call, and a repeated request (a client's retry) is a sibling of its own task's."""
    threads = ThreadSet("s", template)
    last: dict[int, CallNode] = {}
    for task in range(40):
        msgs = [Message("system", "Agent.")]
        for step in range(3):
            msgs.append(Message("user", f"Step {step} of task {task}."))
            call = _one_call(threads, list(msgs), "Done.", template, f"t{task}s{step}")
            if step:
                assert call.kind == "extend" and call.parent is last[task], (task, step)
            last[task] = call
            msgs.append(Message("assistant", "Done."))
    # Task 7's last request again, as the client's retry: its sibling, under its parent.
    msgs = [Message("system", "Agent.")]
    for step in range(3):
        msgs.append(Message("user", f"Step {step} of task 7."))
        if step < 2:
            msgs.append(Message("assistant", "Done."))
    retry = threads.assemble(msgs, TOOLS, None, client_retry=True)
    assert retry.kind == "retry" and retry.sibling_of is last[7]
    threads.release(retry)
    again = _one_call(threads, msgs, "Done.", template, "t7s2-again", retry=True)
    assert again.parent is last[7].parent and again.prompt_ids == last[7].prompt_ids
    rows, thread_of = threads.export()
    assert len({thread_of[f"t{task}s2"] for task in range(40)}) == 40
    assert all(
        thread_of[f"t{task}s0"] == thread_of[f"t{task}s1"] == thread_of[f"t{task}s2"]
        for task in range(40)
        if task != 7
    )
    assert sum(sum(r.loss_mask) for r in rows) == sum(len(c.sampled_ids) for c in threads.calls)


def test_retry_makes_a_dead_sibling_and_the_live_row_keeps_the_history(
    template: ChatTemplate,
) -> None:
    threads = ThreadSet("s", template)
    msgs = [Message("system", "Agent."), Message("user", "Go")]
    first = _one_call(threads, msgs, "step one", template, "r1")
    msgs += [Message("assistant", "step one"), Message("user", "next")]
    lost = _one_call(threads, msgs, "answer A", template, "r2")
    kept = _one_call(threads, msgs, "answer B", template, "r3", retry=True)  # the SDK's retry
    assert kept.parent is first and lost.parent is first and kept.prompt_ids == lost.prompt_ids
    msgs += [Message("assistant", "answer B"), Message("user", "thanks")]
    after = _one_call(threads, msgs, "bye", template, "r4")
    assert after.parent is kept
    rows, thread_of = threads.export()
    live = next(r for r in rows if r.thread_id == thread_of["r4"])
    dead = next(r for r in rows if r.thread_id == thread_of["r2"])
    assert live.trained_request_ids == ["r1", "r3", "r4"] and not live.dead
    assert dead.trained_request_ids == ["r2"] and dead.dead and dead.dead_reason == "superseded"
    assert dead.superseded_by == live.thread_id and dead.parent_thread_id == live.thread_id
    assert dead.parent_relation == "branch"
    # The dead row holds the shared history as context only.
    assert [t["status"] for t in dead.turns] == ["context", "trained"]


def test_twin_sub_agents_each_extend_their_own_thread(template: ChatTemplate) -> None:
    """Two sub-agents spawned with the same instruction, sampled the same first tool call; their
    continuations arrive crossed. The tool-call ids they echo put each on its own thread."""
    threads = ThreadSet("s", template)
    main = [Message("system", "Main."), Message("user", "Split the work")]
    spawn_text = (
        "<tool_call>\n"
        + json.dumps(SPAWN)
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps(SPAWN)
        + "\n</tool_call>"
    )
    parent = _one_call(threads, main, spawn_text, template, "m1")
    sub = [Message("system", "Agent."), Message("user", SPAWN["arguments"]["prompt"])]
    call_text = "<tool_call>\n" + json.dumps(CALLS[0]) + "\n</tool_call>"
    x = _one_call(threads, sub, call_text, template, "x1")
    y = _one_call(threads, sub, call_text, template, "y1")
    assert x.spawned_by and y.spawned_by and x.spawned_by[1] != y.spawned_by[1]
    assert {x.spawned_by[0], y.spawned_by[0]} == {parent}

    def cont(c: CallNode) -> list[Message]:
        tc = ToolCall(next(iter(c.tool_ids)), "bash", '{"cmd":"ls"}')  # its own minted id, echoed
        return sub + [
            Message("assistant", "", tool_calls=(tc,)),
            Message("tool", "out", tool_call_id=tc.id),
        ]

    y2 = _one_call(threads, cont(y), "Done.", template, "y2")
    x2 = _one_call(threads, cont(x), "Done.", template, "x2")
    assert y2.parent is y and x2.parent is x
    rows, thread_of = threads.export()
    assert thread_of["x1"] == thread_of["x2"] != thread_of["y1"] == thread_of["y2"]
    for rid in ("x2", "y2"):
        row = next(r for r in rows if r.thread_id == thread_of[rid])
        assert row.parent_relation == "spawn" and row.parent_thread_id == thread_of["m1"]


def test_compaction_links_the_new_conversation_to_the_summary(template: ChatTemplate) -> None:
    threads = ThreadSet("s", template)
    msgs = [Message("system", "Agent."), Message("user", "Summarize everything so far.")]
    summary = " ".join(
        f"Point {i}: the parser fails on nested input and the fix is in module {i}."
        for i in range(6)
    )
    s = _one_call(threads, msgs, summary, template, "s1")
    fresh = [
        Message("system", "Agent."),
        Message(
            "user",
            "This session is being continued from a previous conversation. Summary:\n" + summary,
        ),
    ]
    c = _one_call(threads, fresh, "ok", template, "c1")
    assert c.parent is None and c.compaction_of is s
    rows, thread_of = threads.export()
    row = next(r for r in rows if r.thread_id == thread_of["c1"])
    assert row.parent_relation == "compaction" and row.parent_thread_id == thread_of["s1"]


def test_a_truncated_history_trains_the_removed_calls_in_a_rewritten_row(
    template: ChatTemplate,
) -> None:
    """A scaffold drops its oldest turns (after "prompt is too long"): the removed calls are not
    lost; they are trained in a row of the sequence they were sampled in, linked to the live one."""
    threads = ThreadSet("s", template)
    msgs = [Message("system", "Agent."), Message("user", "Long task")]
    calls = []
    for i in range(4):
        calls.append(_one_call(threads, msgs, f"step {i} done", template, f"r{i}"))
        msgs += [Message("assistant", f"step {i} done"), Message("user", f"next {i}")]
    # Keep the system and first user message, drop the first two exchanges.
    trimmed = msgs[:2] + msgs[6:]
    last = _one_call(threads, trimmed, "finished", template, "r4")
    assert last.kind == "rewrite" and last.parent is calls[3]
    rows, thread_of = threads.export()
    main = next(r for r in rows if r.thread_id == thread_of["r4"])
    side = next(r for r in rows if r.parent_relation == "rewritten")
    assert main.trained_request_ids == ["r2", "r3", "r4"]
    assert side.trained_request_ids == ["r0", "r1"] and side.parent_thread_id == main.thread_id
    assert thread_of["r0"] == thread_of["r1"] == side.thread_id
    assert side.input_ids == seq_ids(calls[3])
    dropped = [t for t in main.turns if t["status"] == "dropped"]
    assert [t["request_id"] for t in dropped] == ["r0", "r1"]
    assert {t["trained_in"] for t in dropped} == {side.thread_id}
    assert sum(sum(r.loss_mask) for r in rows) == sum(len(c.sampled_ids) for c in (*calls, last))


def test_recovery_from_the_journal_gives_the_same_rows(template: ChatTemplate, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A session with a retry and a rewrite, rebuilt from its journal after a crash, gives the
    rows the live process would have written: same ids, masks, dead flags, links."""
    from capture.storage.sessions import SessionStore
    from rewriter.canonical import ChatRequest
    from tests.support.proxies import read_threads, record_turn

    live, crashed = (
        SessionStore(tmp_path / "live", template),
        SessionStore(tmp_path / "crash", template),
    )
    msgs = [Message("system", "s"), Message("user", "q0")]
    script = [(list(msgs), "a0", False)]
    msgs2 = msgs + [Message("assistant", "a0"), Message("user", "q1")]
    script += [(msgs2, "lost", False), (msgs2, "kept", True)]
    msgs3 = [Message("system", "s"), Message("user", "<r>x</r>q0"), Message("assistant", "a0"),
             Message("user", "q1"), Message("assistant", "kept"), Message("user", "q2")]  # fmt: skip
    script += [(msgs3, "a3", False)]
    for i, (m, text, retry) in enumerate(script):
        ids = template.encode(text) + [template.eos_token_id]
        for store in (live, crashed):
            chat = ChatRequest(messages=list(m), model="m", client_retry=retry)
            record_turn(store, "sess", chat, ids, i, text)
    live.close()
    SessionStore(tmp_path / "crash", template).recover()
    a = sorted(read_threads(tmp_path / "live"), key=lambda r: r["thread_id"])
    b = sorted(read_threads(tmp_path / "crash"), key=lambda r: r["thread_id"])
    assert len(a) == 2 and [r["dead"] for r in a].count(True) == 1
    keys = ["thread_id", "input_ids", "loss_mask", "logprobs", "provenance", "turns", "dead",
            "superseded_by", "parent_thread_id", "parent_relation", "trained_request_ids"]  # fmt: skip
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]


def test_rows_say_which_weights_gave_each_policy_token(template: ChatTemplate) -> None:
    """weight_versions: each call's sampled tokens carry their sampler's spans (a generation
    across an update: two), shifted to the row's positions; tokens a rewrite re-scored carry
    the re-score's version; template and tool tokens none. A journal rebuilds the same."""
    from capture.trajectory.journal import call_entry

    threads = ThreadSet("s", template)
    msgs = [Message("system", "Agent."), Message("user", "Task")]

    def call(text: str, rid: str, versions: list[tuple[str, int, int]],
             recompute: str | None = None) -> CallNode:  # fmt: skip
        a = threads.assemble(msgs, TOOLS, None)
        if a.needs_recompute():
            a.recompute_version = recompute
        ids = template.encode(text) + [template.eos_token_id]
        return threads.commit(a, parse_completion(text).as_message(), ids, [-0.5] * len(ids),
                              request_id=rid, turn_index=0, finish_reason="stop", latency_s=0,
                              backend="b", sampled_versions=versions)  # fmt: skip

    call("Let me check.", "c1", [("v1", 0, 5)])
    msgs += [Message("assistant", "Let me check."), Message("user", "More")]
    n2 = len(template.encode("Done.")) + 1
    c2 = call("Done.", "c2", [("v1", 0, 1), ("v2", 1, n2)])
    rows, _ = threads.export()
    (row,) = rows
    s1, s2 = (next(t for t in row.turns if t["request_id"] == r) for r in ("c1", "c2"))
    assert row.weight_versions == [
        {"version": "v1", "start": s1["start"], "end": s1["end"]},
        {"version": "v1", "start": s2["start"], "end": s2["start"] + 1},
        {"version": "v2", "start": s2["start"] + 1, "end": s2["end"]},
    ]
    assert call_entry(c2)["sampled_versions"] is None  # the turn record holds them
    # A rewrite (the first user message edited): c1's and c2's replies are spliced in; where
    # their logprobs were re-scored, the re-score's weights say so.
    msgs[1] = Message("user", "<system-reminder>x</system-reminder>Task")
    msgs += [Message("assistant", "Done."), Message("user", "Go on")]
    c3 = call("ok", "c3", [("v3", 0, 2)], recompute="v3")
    assert c3.kind == "rewrite"
    rows, _ = threads.export()
    row = next(r for r in rows if "c3" in r.trained_request_ids)
    assert row.provenance.count(2) > 0  # the rewrite re-scored tokens after its edit
    by_pos = {}
    for span in row.weight_versions:
        for p in range(span["start"], span["end"]):
            by_pos[p] = span["version"]
    for pos, prov in enumerate(row.provenance):
        if prov == 2:  # RECOMPUTED
            assert by_pos[pos] == "v3"
        elif prov == 0:
            assert pos not in by_pos
    assert {by_pos[p] for p in range(*next((t["start"], t["end"]) for t in row.turns
                                           if t["request_id"] == "c3"))} == {"v3"}  # fmt: skip
    assert call_entry(c3)["suffix_version"] == ("v3" if 2 in c3.suffix_provenance else None)
