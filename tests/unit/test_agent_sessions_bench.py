"""bench/agent_sessions.py's pure parts: the session plan (sizes in tokens, growth to the
context asked for), the wire shapes' histories and the stream readers. No vLLM, no proxy."""

from __future__ import annotations

import random
import re
from pathlib import Path

import orjson
import pytest

from bench.agent_paths import Call
from bench.agent_plan import (
    Plan,
    Tokenizer,
    build_plan,
    corpus_text,
    openai_tools,
    result_sizes,
    turn_extra,
)
from bench.agent_report import proxy_load, trend_ratio
from bench.agent_run import Results
from bench.agent_sessions import fmt_cpus, main, split_cpus
from bench.agent_wire import (
    AnthropicReader,
    AnthropicShape,
    ChatReader,
    CompletionReader,
    Reply,
    ResponsesReader,
    ResponsesShape,
    Shape,
)


@pytest.fixture(scope="module")
def tok(qwen3_dir: Path):  # type: ignore[no-untyped-def]
    return Tokenizer(qwen3_dir)


@pytest.fixture(scope="module")
def corpus() -> str:
    return corpus_text(200_000)


def test_result_sizes_stay_in_range_and_add_up() -> None:
    rng = random.Random(3)
    for mean in (210.0, 257.0, 600.0, 1500.0):
        sizes = result_sizes(rng, 59, mean)
        assert len(sizes) == 59
        assert all(200 <= n <= 2000 for n in sizes)
        assert abs(sum(sizes) - 59 * mean) <= 59  # rounding, at most one token each
    # Mostly short, now and then long (a whole file read).
    sizes = result_sizes(random.Random(1), 59, 257.0)
    assert statistics_median(sizes) < 257 < max(sizes)
    # Past what the range allows: clamped.
    assert result_sizes(rng, 5, 100.0) == [200] * 5
    assert result_sizes(rng, 5, 5000.0) == [2000] * 5
    assert result_sizes(rng, 0, 300.0) == []


def statistics_median(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2])


@pytest.mark.parametrize(
    ("turns", "system_tokens", "context"), [(60, 12000, 30000), (12, 3000, 8000)]
)
def test_the_plan_grows_to_the_context_asked(
    tok, corpus: str, turns: int, system_tokens: int, context: int
) -> None:  # type: ignore[no-untyped-def]
    plan = build_plan(
        tok, sessions=3, turns=turns, system_tokens=system_tokens, context=context, corpus=corpus
    )
    assert len(plan.tools) == 20
    assert len({t["function"]["name"] for t in plan.tools}) == 20
    # The system text and the tools together: about what was asked.
    tools_tokens = len(tok.encode(orjson.dumps(plan.tools).decode()))
    fixed = len(tok.encode(plan.system)) + tools_tokens
    assert abs(fixed - system_tokens) < 0.05 * system_tokens
    assert len(plan.texts) == 3
    for texts, sizes in zip(plan.texts, plan.result_tokens, strict=True):
        assert len(texts) == turns  # the task, then a tool result per later turn
        measured = [len(tok.encode(t)) for t in texts[1:]]
        # Each text is about its planned size (cut by tokens, decoded, encoded again).
        assert all(abs(m - n) <= 0.1 * n + 5 for m, n in zip(measured, sizes, strict=True))
        assert all(190 <= m <= 2100 for m in measured)
        # The last call's prompt: the first, then every turn's reply, framing and result.
        last = plan.base_tokens + sum(measured) + (turns - 1) * turn_extra(32)
        assert abs(last - context) < 0.05 * context
    # Sessions differ; the system prompt and tools are shared (one agent's, as in a fleet).
    assert plan.texts[0][1] != plan.texts[1][1]
    again = build_plan(
        tok, sessions=3, turns=turns, system_tokens=system_tokens, context=context, corpus=corpus
    )
    assert again.texts == plan.texts and again.system == plan.system


def small_plan() -> object:
    return Plan("system", openai_tools(), [["task", "result one", "result two"]], 0, [[200, 200]])


def test_chat_history_takes_the_reply_and_the_next_result() -> None:
    shape = Shape(small_plan(), 0, "m", 32)
    body = shape.body()
    assert body["ignore_eos"] is True and body["max_tokens"] == 32 and body["stream"] is True
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    shape.add(Reply(echo={"role": "assistant", "content": "a"}), 0)
    assert shape.messages[-2:] == [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "result one"},
    ]
    shape.add(Reply(echo={"role": "assistant", "content": ""}, tool_ids=["c1", "c2"]), 1)
    assert shape.messages[-2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "result two"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
    ]


def test_anthropic_and_responses_histories() -> None:
    anth = AnthropicShape(small_plan(), 0, "m", 32)
    assert anth.body()["system"][0]["text"] == "system"
    assert anth.body()["tools"][0]["input_schema"]["type"] == "object"
    anth.add(Reply(echo=[{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}],
                         tool_ids=["t1"]), 0)  # fmt: skip
    assert anth.messages[-1]["content"][0] == {
        "type": "tool_result", "tool_use_id": "t1", "content": "result one",
    }  # fmt: skip
    resp = ResponsesShape(small_plan(), 0, "m", 32)
    assert resp.body()["instructions"] == "system" and resp.body()["max_output_tokens"] == 32
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}
    resp.add(Reply(echo=[item]), 0)
    assert resp.messages[-2] == item
    assert resp.messages[-1]["content"][0]["text"] == "result one"


def test_readers_count_tokens_and_find_the_first_text() -> None:
    chat = ChatReader()
    assert not chat.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert chat.feed({"choices": [{"delta": {"content": "hi"}}]})
    chat.feed({"choices": [{"delta": {"tool_calls": [
        {"index": 0, "id": "c1", "function": {"name": "Bash", "arguments": '{"a"'}}]}}]})  # fmt: skip
    chat.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}}]})  # fmt: skip
    chat.feed({"choices": [], "usage": {"completion_tokens": 32, "prompt_tokens": 900}})
    reply = chat.finish()
    assert (reply.tokens, reply.prompt_tokens, reply.text) == (32, 900, "hi")
    assert reply.tool_ids == ["c1"]
    assert reply.echo["tool_calls"][0]["function"]["arguments"] == '{"a":1}'

    anth = AnthropicReader()
    anth.feed({"type": "message_start", "message": {"usage": {"input_tokens": 70}}})
    anth.feed({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})  # fmt: skip
    assert anth.feed({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "yo"}})  # fmt: skip
    anth.feed({"type": "message_delta", "usage": {"output_tokens": 32}})
    reply = anth.finish()
    assert (reply.tokens, reply.prompt_tokens) == (32, 70)
    assert reply.echo == [{"type": "text", "text": "yo"}]

    resp = ResponsesReader()
    assert resp.feed({"type": "response.output_text.delta", "delta": "x"})
    item = {"type": "message", "content": [{"type": "output_text", "text": "x"}]}
    resp.feed({"type": "response.completed", "response": {
        "output": [item], "usage": {"output_tokens": 32, "input_tokens": 5}}})  # fmt: skip
    reply = resp.finish()
    assert (reply.tokens, reply.text, reply.echo) == (32, "x", [item])


def test_the_completion_reader_counts_ids_either_way_vllm_spells_them() -> None:
    """Without a usage chunk the reader counts ids: ``token_ids`` (return_token_ids) or the
    ``token_id:N`` tokens (return_tokens_as_token_ids, the body agenttap sends)."""
    for choices in (
        [{"text": "a", "token_ids": [5, 6]}, {"text": "b", "token_ids": [7]}],
        [{"text": "a", "token_ids": None, "logprobs": {"tokens": ["token_id:5", "token_id:6"]}},
         {"text": "b", "token_ids": None, "logprobs": {"tokens": ["token_id:7"]}}],
    ):  # fmt: skip
        reader = CompletionReader()
        for choice in choices:
            assert reader.feed({"choices": [choice]})
        reply = reader.finish()
        assert reader.ids == [5, 6, 7] and reply.tokens == 3 and reply.text == "ab"


def test_proxy_load_is_cpu_over_wall_per_process(capsys: pytest.CaptureFixture[str]) -> None:
    results = Results()
    # Two turns of 4 calls each through 2 processes: 0.4 s and 0.8 s of CPU over 2 s and 4 s.
    results.window = {("agenttap", 1): 2.0, ("agenttap", 2): 4.0}
    results.proxy_cpu_fine = {("agenttap", 1): 0.4, ("agenttap", 2): 0.8}
    calls = [Call("agenttap", s, t, 10.0, 1.0, 32, 100) for t in (1, 2) for s in range(4)]
    proxy_load(results, {"agenttap": calls}, ["agenttap"], {"agenttap": 2})
    row = capsys.readouterr().out.strip().splitlines()[-1]
    # 8 calls in 6 s; 1.2 s of CPU over 6 s over 2 processes = 10%; the busiest turn 0.4/2/2;
    # 150 ms of CPU a call: one process carries 6.7 calls/s.
    assert row == "| agenttap | 2 | 1.3 | 10% | 10% | 6.7 |"


def test_vllm_cpus_split_the_cores_between_vllm_and_the_rest() -> None:
    assert split_cpus("1", {0, 1}) == ({1}, {0})
    assert split_cpus("2-3", {0, 1, 2, 3}) == ({2, 3}, {0, 1})
    assert split_cpus("0, 2", {0, 1, 2, 3}) == ({0, 2}, {1, 3})
    assert fmt_cpus({3, 0, 2}) == "0,2,3"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("one", "not a list of cores"),
        ("1-", "not a list of cores"),
        ("3-1", "runs backwards"),
        ("5", "core(s) 5 are not among this process's 0,1"),
        ("0-1", "no core for the client and the proxies"),
    ],
)
def test_vllm_cpus_refuses_what_it_cannot_pin(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        split_cpus(spec, {0, 1})


def test_vllm_cpus_with_a_running_vllm_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--vllm-cpus", "1", "--vllm-url", "http://127.0.0.1:1"])
    assert "not one at --vllm-url" in capsys.readouterr().err


def test_trend_ratio_follows_the_line_and_shrugs_off_a_spike() -> None:
    flat = {t: 20.0 for t in range(2, 61)}
    assert trend_ratio(flat, 5, 60) == pytest.approx(1.0)
    growing = {t: 10.0 + 0.2 * t for t in range(2, 61)}  # 11 at turn 5, 22 at turn 60
    assert trend_ratio(growing, 5, 60) == pytest.approx(22 / 11)
    spiky = dict(flat)
    spiky[59], spiky[60] = 80.0, 90.0  # two slowed turns at the end
    assert trend_ratio(spiky, 5, 60) == pytest.approx(1.0)
    assert trend_ratio({2: 1.0, 3: 2.0}, 5, 60) is None
    assert trend_ratio({2: 10.0, 3: 5.0, 4: 0.0}, 5, 60) is None  # the line is below zero
