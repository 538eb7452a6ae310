"""Sessions a trainer drives (capture/control/sessions.py), the rows they are written into
(capture/storage/sessions.py RowAnnotations), token-level placement and the white-box request parser:
in-process, no sockets."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from capture.control.endpoints import Endpoints
from capture.control.sessions import (
    EndReason,
    Limits,
    SessionControl,
    check_metadata,
    check_session_id,
    parse_limits,
)
from capture.options import parse_settings
from capture.options.values import (
    parse_host,
    parse_passthrough,
    parse_port,
    parse_token,
    passes_through,
)
from capture.pipeline.whitebox import parse_generate
from capture.storage.records import TurnRecord
from capture.storage.sessions import RowAnnotations, SessionStore
from capture.trajectory import AUXILIARY, MAIN
from rewriter.canonical import ChatRequest, Message
from rewriter.template import ChatTemplate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_limits_are_parsed_with_clear_errors() -> None:
    assert parse_limits(None) == Limits()
    assert parse_limits({"max_calls": 3, "deadline_s": 2}) == Limits(3, None, 2.0)
    for bad, words in [
        ({"max_calls": 0}, "max_calls"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_calls": True}, "max_calls"),
        ({"deadline_s": float("nan")}, "deadline_s"),
        ({"deadline_s": -1}, "deadline_s"),
        ({"max_turns": 3}, "unknown limit"),
        ([1], "must be an object"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_limits(bad)
    assert check_session_id("task-1.run_2") == "task-1.run_2"
    for bad_id in ["", "a b", "a:b", "a@b", "-x", "x" * 129, 5]:
        with pytest.raises(ValueError, match='"id"'):
            check_session_id(bad_id)
    assert check_metadata({"split": "val", "x": [1]}) == {"split": "val", "x": [1]}
    with pytest.raises(ValueError, match="split"):
        check_metadata({"split": "test"})
    with pytest.raises(ValueError, match="JSON object"):
        check_metadata("task")


def test_each_limit_refuses_the_next_call_and_is_the_end_reason() -> None:
    clock = Clock()
    control = SessionControl(clock=clock)
    control.open("calls", limits=Limits(max_calls=2))
    control.open("tokens", limits=Limits(max_tokens=10))
    control.open("deadline", limits=Limits(deadline_s=5))
    for _ in range(2):
        assert control.refusal("calls") is None
        control.call_started("calls")
        control.note_recorded("calls", 10, 3, 0.1)
        control.call_finished("calls")
    assert control.refusal("calls") == EndReason.MAX_CALLS
    assert control.tokens_left("tokens") == 10
    control.note_recorded("tokens", 5, 10, 0.1)
    assert control.tokens_left("tokens") == 0
    assert control.refusal("tokens") == EndReason.MAX_TOKENS
    assert control.refusal("deadline") is None
    clock.now += 5
    assert control.refusal("deadline") == EndReason.DEADLINE
    ended = {sid: control.close(sid) for sid in ("calls", "tokens", "deadline")}
    assert {sid: s.end_reason for sid, s in ended.items()} == {
        "calls": EndReason.MAX_CALLS,
        "tokens": EndReason.MAX_TOKENS,
        "deadline": EndReason.DEADLINE,
    }
    assert ended["calls"].metrics.calls == 2 and ended["calls"].metrics.refused == 1
    assert ended["deadline"].metrics.wall_time_s == 5
    # A closed session's calls are refused; reopening the name starts afresh.
    assert control.refusal("calls") == EndReason.CLOSED
    control.open("calls")
    assert control.refusal("calls") is None


def test_calls_in_flight_count_against_max_calls() -> None:
    control = SessionControl()
    control.open("burst", limits=Limits(max_calls=2))
    started = 0
    for _ in range(5):  # five calls at once: two may go
        if control.refusal("burst") is None:
            control.call_started("burst")
            started += 1
    assert started == 2


def test_open_twice_is_refused_and_unopened_sessions_are_counted_then_kept_visible() -> None:
    control = SessionControl()
    started: list[str] = []
    control.on_new = started.append
    control.open("a")
    with pytest.raises(ValueError, match="open already"):
        control.open("a")
    # A proxy username nobody opened is counted as it calls...
    assert control.refusal("user-x") is None
    control.note_recorded("user-x", 3, 4, 0.5, retry=True)
    summary = control.get("user-x")
    assert summary is not None and summary.metrics.retries == 1 and not summary.opened
    # ... opening it later starts it empty (its calls so far stay apart under a name of their
    # own: an agent must not plant calls in a session the trainer opens later) ...
    control.open("user-x", {"task_id": "t"})
    assert control.get("user-x").metrics.calls == 0  # type: ignore[union-attr]
    (apart,) = [s for s in control._past.values() if s.id.startswith("user-x~unopened-")]
    assert apart.metrics.retries == 1 and not apart.opened and apart.metadata == {}
    # ... and one never opened leaves the live ones once the store no longer has it, still
    # answered (GET /sessions/{id}) with its metrics and wall time so far.
    control.refusal("user-y")
    control.call_started("user-y")
    control.note_recorded("user-y", 3, 4, 0.5)
    control.call_finished("user-y")
    control.prune(keep=set())
    past = control.get("user-y")
    assert past is not None and past.metrics.calls == 1 and past.metrics.wall_time_s >= 0
    assert "user-y" not in {s.id for s in control.live()}
    # A new call makes it live again, the same session (counted once).
    assert control.refusal("user-y") is None and control.get("user-y") is past
    assert "user-y" in {s.id for s in control.live()}
    assert started == ["a", "user-x", "user-x", "user-y"]  # the opened user-x is new
    assert control.close("a").end_reason == EndReason.STOP


def test_annotations_are_written_into_every_thread_row(tmp_path: Path, qwen3_dir: Path) -> None:
    template = ChatTemplate(qwen3_dir)
    store = SessionStore(tmp_path, template)
    store.annotations_for = lambda sid: RowAnnotations(metadata={"task_id": sid})
    for i, text in enumerate(["one", "two"]):
        chat_messages = [Message("user", text)]
        assembly = store.assemble("s", ChatRequest(chat_messages, "m"))
        ids = template.encode(f"answer {i}") + [template.eos_token_id]
        store.record(_record("s", f"r{i}", i, assembly.prompt_ids, ids), assembly,
                     Message("assistant", f"answer {i}"))  # fmt: skip
    # A mid-session flush takes the session's metadata; rows are collected as written.
    rows: list[dict] = []
    paths = store.end_session("s", keep_threads=True, rows_out=rows)
    assert len(rows) == 2 and all(json.loads(r["metadata"]) == {"task_id": "s"} for r in rows)
    assert store.written_threads("s") == [p for p in paths if p.parent.name == "threads"]
    table = pq.read_table(store.written_threads("s"))
    assert table.column("reward").to_pylist() == [None, None]
    # Per-thread rewards at close; pending rows are the ones not written yet.
    assembly = store.assemble("s", ChatRequest([Message("user", "three")], "m"))
    store.record(_record("s", "r2", 2, assembly.prompt_ids, [1, 2, template.eos_token_id]),
                 assembly, Message("assistant", "x"))  # fmt: skip
    pending = store.pending_rows("s")
    assert len(pending) == 1 and pending[0]["reward"] is None
    tid = pending[0]["thread_id"]
    rows = []
    store.end_session(
        "s",
        annotations=RowAnnotations(reward={tid: 0.5}, end_reason="stop", metrics={"calls": 3}),
        rows_out=rows,
    )
    assert [(r["thread_id"], r["reward"], r["end_reason"]) for r in rows] == [(tid, 0.5, "stop")]
    assert json.loads(rows[0]["metrics"]) == {"calls": 3}
    assert len(store.written_threads("s", forget=True)) == 2 and store.written_threads("s") == []


@pytest.mark.parametrize("reward_auxiliary", [False, True])
def test_close_rewards_auxiliary_rows_only_when_asked(
    tmp_path: Path, qwen3_dir: Path, reward_auxiliary: bool
) -> None:
    """A close with one number sets it on the main rows and, only with reward_auxiliary, on the
    auxiliary ones (Claude Code's title call), for the rows written at the close and for those
    an earlier flush wrote (late rewards, which readers join): both say the same."""
    from capture.control.api import ControlAPI
    from capture.gateway import Gateway, GatewayConfig
    from capture.storage.reader import load_threads
    from tests.unit.trajectory.test_thread_kind import CLAUDE_SYSTEM, CLAUDE_TOOLS, hermes, record

    gateway = Gateway(GatewayConfig(["http://127.0.0.1:9"], qwen3_dir, tmp_path))
    api = ControlAPI(gateway, "t" * 32, Endpoints("http://127.0.0.1:1", "", "/ca.pem"))
    gateway.control.open("s", {"task_id": "t"})
    store = gateway.store
    msgs = [Message("system", CLAUDE_SYSTEM), Message("user", "Create hello.txt")]
    reply = record(store, "s", "r0", msgs, hermes("Write", {"file_path": "h"}), CLAUDE_TOOLS)
    record(store, "s", "r1", [Message("system", "Generate a title."), Message("user", "Create")],
           '{"title": "Hello"}', constrained=True)  # fmt: skip
    store.end_session("s", keep_threads=True)  # an idle flush: two rows written before close
    msgs += [reply, Message("tool", "ok", tool_call_id=reply.tool_calls[0].id)]
    record(store, "s", "r2", msgs, "Done.", CLAUDE_TOOLS)
    closed = asyncio.run(api.close_session("s", 1.0, reward_auxiliary=reward_auxiliary))
    assert closed is not None
    _, rows, _ = closed
    title = 1.0 if reward_auxiliary else None
    expected = {("r0",): (MAIN, 1.0), ("r1",): (AUXILIARY, title), ("r2",): (MAIN, 1.0)}
    got = {tuple(r["trained_request_ids"]): (r["thread_kind"], r["reward"]) for r in rows}
    assert got == expected
    read = load_threads(tmp_path)
    assert {tuple(r["trained_request_ids"]): (r["thread_kind"], r["reward"]) for r in read} == (
        expected
    )
    # A per-thread reward names what it rewards, auxiliary rows included.
    gateway.control.open("p")
    record(store, "p", "q0", [Message("user", "Create")], "x", CLAUDE_TOOLS)
    record(store, "p", "q1", [Message("system", "Title."), Message("user", "C")], "T")
    rows = asyncio.run(api.close_session("p", {"t-q1": 0.5}))[1]  # type: ignore[index]
    assert {r["thread_id"]: (r["thread_kind"], r["reward"]) for r in rows} == {
        "t-q0": (MAIN, None), "t-q1": (AUXILIARY, 0.5),
    }  # fmt: skip


def _record(sid: str, rid: str, i: int, prompt: list[int], ids: list[int]) -> TurnRecord:
    return TurnRecord(
        session_id=sid, request_id=rid, turn_index=i, protocol="tokens", requested_model="m",
        policy_model="p", backend="b", user_agent="ua", prompt_ids=prompt, completion_ids=ids,
        completion_logprobs=[-0.25] * len(ids), finish_reason="stop",
        response_finish_reason="stop", started_at=0.0, latency_s=0.1, stream=False,
    )  # fmt: skip


def test_token_calls_extend_the_call_whose_whole_sequence_they_start_with(
    tmp_path: Path, qwen3_dir: Path
) -> None:
    store = SessionStore(tmp_path, ChatTemplate(qwen3_dir))
    first = store.assemble_tokens("t", [1, 2, 3])
    assert first.parent is None and first.kind == "new"
    store.record(_record("t", "g1", 0, [1, 2, 3], [4, 5]), first, Message("assistant", ""))
    second = store.assemble_tokens("t", [1, 2, 3, 4, 5, 6, 7])
    assert second.parent is not None and second.parent.request_id == "g1"
    assert second.base == 5 and second.kind == "extend"
    store.record(_record("t", "g2", 1, second.prompt_ids, [8]), second, Message("assistant", ""))
    # Not a prefix of any call's sequence: a tree of its own.
    assert store.assemble_tokens("t", [1, 2, 9]).parent is None
    (row,) = store.pending_rows("t")
    assert row["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1]


def test_generate_requests_are_checked() -> None:
    ids, sampling, model = parse_generate(
        {"token_ids": [1, 2], "sampling_params": {"max_tokens": 4, "temperature": 1}}
    )
    assert ids == [1, 2] and sampling.max_tokens == 4 and sampling.temperature == 1.0
    assert model == ""
    for body, words in [
        ([], "JSON object"),
        ({"token_ids": []}, "non-empty"),
        ({"token_ids": [-1]}, "non-empty"),
        ({"token_ids": [True]}, "non-empty"),
        ({"token_ids": [1], "sampling_params": {"n": 2}}, "not served"),
        ({"token_ids": [1], "sampling_params": {"seed": 1.5}}, "seed"),
        ({"token_ids": [1], "sampling_params": {"temperature": float("inf")}}, "temperature"),
        ({"token_ids": [1], "sampling_params": {"stop": [1]}}, "stop"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "at least 1"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_generate(body)


def test_a_session_environment_serves_every_client() -> None:
    ends = Endpoints("http://10.0.0.5:9001", "http://10.0.0.5:9000", "/ca.pem")
    env = ends.env("run-1")
    assert env["HTTPS_PROXY"] == "http://run-1:x@10.0.0.5:9000"
    for name in (
        "SSL_CERT_FILE",
        "NODE_EXTRA_CA_CERTS",
        "REQUESTS_CA_BUNDLE",
        "CODEX_CA_CERTIFICATE",
    ):
        assert env[name] == "/ca.pem"
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY"):
        assert env[name]
    assert ends.base_urls("run-1") == {
        "openai": "http://10.0.0.5:9001/sess/run-1/v1",
        "anthropic": "http://10.0.0.5:9001/sess/run-1/anthropic",
        "gemini": "http://10.0.0.5:9001/sess/run-1/gemini",
    }


def test_api_options_are_checked() -> None:
    assert parse_host(" 0.0.0.0 ") == "0.0.0.0" and parse_host("::1") == "::1"
    assert parse_port("0") == 0 and parse_port("8081") == 8081
    strong = "k3Y-" + "abcdefghij" * 2
    assert parse_token("") == "" and parse_token(strong) == strong
    weak = ["short", "a" * 16, "a" * 40, "k3Y-abcdefghij-abcdefg", "x y" * 10]
    for parse, bad in [(parse_host, "a b"), (parse_port, "70000")] + [
        (parse_token, w) for w in weak
    ]:
        with pytest.raises(ValueError):
            parse(bad)


def test_a_weak_token_is_refused_and_never_echoed() -> None:
    with pytest.raises(ValueError) as refused:
        parse_settings({"agenttap_token": "a" * 30})
    assert "too weak" in str(refused.value) and "a" * 30 not in str(refused.value)
    with pytest.raises(ValueError) as bad_char:
        parse_settings({"agenttap_token": "secret with spaces-0123456789"})
    assert "secret with spaces" not in str(bad_char.value)


def test_the_token_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("k3Y-abcdefghij-abcdefghij\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        parse_settings({"agenttap_token_file": str(path)})
    path.chmod(0o600)
    assert parse_settings({"agenttap_token_file": str(path)}).token == "k3Y-abcdefghij-abcdefghij"
    with pytest.raises(ValueError, match="both set"):
        parse_settings(
            {"agenttap_token_file": str(path), "agenttap_token": "k3Y-abcdefghij-abcdefghij"}
        )


def test_session_ids_are_matched_whole() -> None:
    for bad in ["nl\n", "a/b", "..", "a\x00", "", "-x", "x" * 129]:
        with pytest.raises(ValueError):
            check_session_id(bad)
    assert check_session_id("s-1.a_b") == "s-1.a_b"


def test_an_opened_session_wants_its_secret_and_a_refusal_touches_nothing() -> None:
    control = SessionControl()
    sess = control.open("victim", {"task": "t"}, parse_limits({"max_calls": 1}))
    assert len(sess.secret) >= 24 and sess.secret not in str(sess.summary())
    for given in ([], [""], ["x"], [sess.secret[:-1]]):
        assert control.credential_refusal("victim", given) is not None
    assert control.credential_refusal("victim", ["x", sess.secret]) is None
    assert sess.metrics.refused == 0 and sess.in_flight == 0  # nothing counted
    # Never opened: anyone, unless every session must be opened.
    assert control.credential_refusal("free", []) is None
    assert control.credential_refusal("free", [], required=True) is not None
    control.close("victim")
    assert control.credential_refusal("victim", []) is not None  # closed: still its own


def test_passthrough_patterns_never_let_an_api_host_through() -> None:
    patterns = parse_passthrough("pypi.org, *.pythonhosted.org,GitHub.com")
    assert patterns == ("pypi.org", "*.pythonhosted.org", "github.com")
    assert passes_through("files.pythonhosted.org", patterns)
    assert passes_through("GITHUB.COM.", patterns) and not passes_through(
        "api.github.com", patterns
    )
    for bad in ["*", "a b", "https://pypi.org"]:
        with pytest.raises(ValueError):
            parse_passthrough(bad)
    for overlapping in ["*.openai.com", "api.anthropic.com", "*.googleapis.com"]:
        with pytest.raises(ValueError, match="would let .* through"):
            parse_settings({"agenttap_passthrough": overlapping})
    assert parse_settings({"agenttap_passthrough": "pypi.org"}).passthrough == ("pypi.org",)
