"""A trainer drives agenttap: the launcher starts a real mitmdump on free ports, the control API
opens sessions with metadata and limits, real SDKs call in proxy mode and in base-URL mode, and
closing with a reward returns the rows (reward, metadata, end_reason, metrics set); late rewards
are joined for readers. The policy is the vLLM-shaped stub (its replies are scripted)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from capture.client.launcher import AgentTap, AgentTapError, AsyncAgentTap, Session
from capture.storage.advantages import load_advantages
from capture.storage.reader import load_threads
from tests.support.paths import IM_END, QWEN3
from tests.support.stub_vllm import StubPolicy


@pytest.fixture
def tap(stub_tap: AgentTap) -> AgentTap:
    return stub_tap


def http(
    url: str, method: str = "GET", token: str | None = None, body: Any = None, proxy: str = ""
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    handlers = [urllib.request.ProxyHandler({"http": proxy} if proxy else {})]
    try:
        with urllib.request.build_opener(*handlers).open(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat(where: Any, text: str, history: list[dict[str, Any]] | None = None) -> Any:
    """One chat call in base-URL mode: ``where`` is a session (its base URL and its secret as
    the API key) or a bare base URL (a session never opened: any key)."""
    import openai

    if isinstance(where, str):
        base_url, key = where, "sk-test"
    else:
        base_url, key = where.base_urls["openai"], where.api_key
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    messages = (history or []) + [{"role": "user", "content": text}]
    return client.chat.completions.create(model="policy", messages=messages)


def test_every_route_but_health_wants_the_token(tap: AgentTap, stub: StubPolicy) -> None:
    api = tap.api_url
    assert http(f"{api}/healthz") == (200, {"ok": True})
    # /ready answers anyone, but only whether it is ready: the servers' URLs (a unix socket's
    # private path), the model and the reasons are the token holder's.
    assert http(f"{api}/ready") == (200, {"ready": True})
    assert http(f"{api}/ready", token="wrong-token-0123456789") == (200, {"ready": True})
    assert http("http://agenttap.local/ready", proxy=tap.proxy_url) == (200, {"ready": True})
    status, ready = http(f"{api}/ready", token=tap.token)
    assert status == 200 and ready["ready"] is True and ready["model"] == "stub-policy"
    assert [r["url"] for r in ready["replicas"]] == [stub.url]
    status, ready = http("http://agenttap.local/ready", token=tap.token, proxy=tap.proxy_url)
    assert status == 200 and ready["replicas"][0]["url"] == stub.url
    for method, path in [
        ("GET", "/sessions"),
        ("POST", "/sessions"),
        ("GET", "/openapi.json"),
        ("POST", "/flush"),
        ("POST", "/sessions/x/close"),
        ("POST", "/sessions/x/advantage"),
    ]:
        status, body = http(f"{api}{path}", method, body={} if method == "POST" else None)
        assert status == 401, (path, body)
        assert "Authorization: Bearer TOKEN" in body["error"]["message"]
        status, body = http(f"{api}{path}", method, token="wrong-token-0123456789")
        assert status == 403, (path, body)
    status, spec = http(f"{api}/openapi.json", token=tap.token)
    assert status == 200 and spec["openapi"].startswith("3.")
    for path in ["/sessions", "/sessions/{id}/close", "/sessions/{id}/reward", "/healthz",
                 "/sessions/{id}/advantage"]:  # fmt: skip
        assert path in spec["paths"]
    status, body = http(f"{api}/sessions/nope", token=tap.token)
    assert status == 404 and "no session 'nope'" in body["error"]["message"]
    # The same API through the proxy, at http://agenttap.local: the token is checked there too,
    # and never stored in a flow.
    proxy = tap.proxy_url
    assert http("http://agenttap.local/sessions", proxy=proxy)[0] == 401
    assert (
        http("http://agenttap.local/sessions", token="wrong-token-0123456", proxy=proxy)[0] == 403
    )
    status, body = http("http://agenttap.local/sessions", token=tap.token, proxy=proxy)
    assert status == 200 and "sessions" in body
    # A bad request body is the caller's 400, naming what is wrong.
    status, body = http(f"{api}/sessions", "POST", tap.token, {"limits": {"max_calls": 0}})
    assert status == 400 and "max_calls" in body["error"]["message"]
    status, body = http(f"{api}/sessions", "POST", tap.token, {"metadata": {"split": "test"}})
    assert status == 400 and "split" in body["error"]["message"]


def test_proxy_mode_session_closed_with_reward_then_a_late_one(
    tap: AgentTap, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = {"task_id": "task-7", "group_id": "grp-1", "split": "train", "seed": [1, 2]}
    sess = tap.open_session(metadata=meta)
    # Proxy mode: the session's own environment is all the real SDK gets.
    for key, value in sess.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    import openai

    client = openai.OpenAI(max_retries=0, timeout=60)
    stub.replies.clear()
    stub.script("First answer.", "Second answer.")
    n = len(stub.requests)
    first = client.chat.completions.create(
        model="gpt-5", messages=[{"role": "user", "content": "one"}]
    )
    history = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "two"},
    ]
    client.chat.completions.create(model="gpt-5", messages=history)
    live = {s["id"]: s for s in tap.sessions()}
    assert live[sess.id]["metrics"]["calls"] == 2 and live[sess.id]["metadata"] == meta
    # Live status: the policy server its calls go to, and when it was last active.
    assert live[sess.id]["backend"] == stub.url.rstrip("/")
    assert time.time() - 60 < live[sess.id]["last_active_at"] <= time.time()

    table = sess.close(reward=2.5)
    assert isinstance(table, pa.Table)
    rows = table.to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert row["session_id"] == sess.id and row["num_turns"] == 2
    assert row["reward"] == 2.5 and json.loads(row["metadata"]) == meta
    assert row["end_reason"] == "stop"
    # The row holds exactly what the policy was sent and sampled.
    second = list(tok.encode("Second answer.", add_special_tokens=False)) + [IM_END]
    assert row["input_ids"] == stub.requests[n + 1]["prompt"] + second
    metrics = json.loads(row["metrics"])
    assert metrics == sess.metrics
    assert metrics["calls"] == 2 and metrics["errors"] == 0 and metrics["refused"] == 0
    assert metrics["prompt_tokens"] == len(stub.requests[n]["prompt"]) + len(
        stub.requests[n + 1]["prompt"]
    )
    assert (
        metrics["completion_tokens"]
        == len(second) + len(tok.encode("First answer.", add_special_tokens=False)) + 1
    )
    assert metrics["wall_time_s"] > 0 and metrics["policy_time_s"] > 0
    assert sess.id not in {s["id"] for s in tap.sessions()}

    # A late reward (a verifier that ran after the agent exited) is joined for every reader.
    sess.reward(-1.0)
    assert sess.rows().column("reward").to_pylist() == [-1.0]
    read = [r for r in load_threads(tap.out) if r["session_id"] == sess.id]
    assert [r["reward"] for r in read] == [-1.0]
    # Closing twice, or a late reward for a session still open, is refused with the reason.
    with pytest.raises(AgentTapError, match="closed already") as err:
        sess.close()
    assert err.value.status == 409
    other = tap.open_session()
    with pytest.raises(AgentTapError, match="still open"):
        other.reward(1.0)
    other.close()
    # The trainer's own advantage (open or closed): kept for the viewer; a value that is not
    # a finite number is refused in words, an unknown session is a 404, and neither is kept.
    tap.advantage(sess.id, -0.75, step=3, step_s=41.5)
    assert load_advantages(tap.out)[sess.id] == pytest.approx(
        {"advantage": -0.75, "step": 3, "step_s": 41.5,
         "set_at": load_advantages(tap.out)[sess.id]["set_at"]}
    )  # fmt: skip
    url = f"{tap.api_url}/sessions/{sess.id}/advantage"
    for bad in ({"advantage": "high"}, {"advantage": True}, {"step": 1}):
        status, body = http(url, "POST", tap.token, bad)
        assert status == 400 and '"advantage"' in body["error"]["message"], (bad, body)
    status, body = http(url, "POST", tap.token, {"advantage": 1.0, "step": -1})
    assert status == 400 and '"step"' in body["error"]["message"]
    for bad_s in (-1.0, "12", True):
        status, body = http(url, "POST", tap.token, {"advantage": 1.0, "step_s": bad_s})
        assert status == 400 and '"step_s"' in body["error"]["message"], (bad_s, body)
    # Infinity (1e400 as Python reads it) is refused by the body parse before any field is read.
    status, body = http(url, "POST", tap.token, {"advantage": 1.0, "step_s": 1e400})
    assert status == 400 and "numbers must be finite" in body["error"]["message"], body
    with pytest.raises(AgentTapError) as err:
        tap.advantage("no-such-session", 1.0)
    assert err.value.status == 404
    assert load_advantages(tap.out) == {sess.id: load_advantages(tap.out)[sess.id]}
    assert load_advantages(tap.out)[sess.id]["advantage"] == -0.75


def test_close_answers_json_with_per_thread_rewards(tap: AgentTap, stub: StubPolicy) -> None:
    sess = tap.open_session(id="json-close", metadata={"task_id": "j"})
    stub.replies.clear()
    stub.script("A.", "B.")
    # Two separate conversations: two thread rows.
    chat(sess, "first conversation")
    chat(sess, "another conversation")
    rows = sess.rows().to_pylist()
    assert len(rows) == 2 and all(r["reward"] is None for r in rows)
    rewards = {rows[0]["thread_id"]: 1.0, rows[1]["thread_id"]: 0.0, "t-unknown": 5.0}
    url = f"{tap.api_url}/sessions/json-close/close"
    # A thread it has no row of: a 400 naming it, and nothing is closed.
    status, body = http(url, "POST", tap.token, {"reward": rewards})
    assert status == 400 and "t-unknown" in body["error"]["message"], body
    assert "json-close" in {s["id"] for s in tap.sessions()}
    del rewards["t-unknown"]
    status, body = http(url, "POST", tap.token, {"reward": rewards})
    assert status == 200
    assert {r["thread_id"]: r["reward"] for r in body["rows"]} == {
        rows[0]["thread_id"]: 1.0,
        rows[1]["thread_id"]: 0.0,
    }
    assert "unmatched_rewards" not in body
    assert body["end_reason"] == "stop" and body["metrics"]["calls"] == 2


def test_base_url_mode_serves_all_four_providers_exactly(
    tap: AgentTap, stub: StubPolicy, tok: Any
) -> None:
    import anthropic
    import openai
    from google import genai
    from google.genai import types

    sess = tap.open_session(metadata={"task_id": "base-urls"})
    urls = sess.base_urls
    assert urls["openai"] == f"{tap.api_url}/sess/{sess.id}/v1"
    stub.replies.clear()
    stub.script("Chat.", "Responses.", "Messages.", "Gemini.")
    n = len(stub.requests)
    oai = openai.OpenAI(base_url=urls["openai"], api_key=sess.api_key, max_retries=0, timeout=60)
    got = [oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "c"}])]
    assert got[0].choices[0].message.content == "Chat."
    assert oai.responses.create(model="m", input="r").output_text == "Responses."
    ant = anthropic.Anthropic(base_url=urls["anthropic"], api_key=sess.api_key, max_retries=0)
    msg = ant.messages.create(
        model="claude-opus-5-5", max_tokens=100, messages=[{"role": "user", "content": "a"}]
    )
    assert msg.content[0].text == "Messages."  # type: ignore[union-attr]
    gem = genai.Client(
        api_key=sess.api_key,
        http_options=types.HttpOptions(base_url=urls["gemini"], timeout=60_000),
    )
    assert gem.models.generate_content(model="gemini-2.5-flash", contents="g").text == "Gemini."

    rows = sess.close(reward=1.0).to_pylist()
    assert sorted(r["protocol"] for r in rows) == [
        "anthropic.messages",
        "gemini.generate_content",
        "openai.chat",
        "openai.responses",
    ]
    for i, text in enumerate(["Chat.", "Responses.", "Messages.", "Gemini."]):
        sampled = list(tok.encode(text, add_special_tokens=False)) + [IM_END]
        row = next(r for r in rows if r["input_ids"][-len(sampled) :] == sampled)
        assert row["input_ids"] == stub.requests[n + i]["prompt"] + sampled
        assert row["loss_mask"][-len(sampled) :] == [1] * len(sampled)
    assert sess.metrics["calls"] == 4


def test_limits_end_the_session_with_a_final_answer(tap: AgentTap, stub: StubPolicy) -> None:
    import openai

    stub.replies.clear()
    # max_calls: the third call is refused, never reaches the policy, and says so.
    sess = tap.open_session(limits={"max_calls": 2})
    n = len(stub.requests)
    chat(sess, "1")
    chat(sess, "2")
    with pytest.raises(openai.BadRequestError) as err:
        chat(sess, "3")
    assert err.value.response.headers["x-should-retry"] == "false"
    assert "max_calls" in str(err.value)
    assert len(stub.requests) == n + 2
    sess.close()
    assert sess.end_reason == "max_calls" and sess.metrics["refused"] == 1

    # max_tokens: a call's budget is what is left, so the session samples exactly the limit.
    sess = tap.open_session(limits={"max_tokens": 5})
    stub.script("one two three four five six seven eight nine ten")
    first = chat(sess, "count")
    assert first.choices[0].finish_reason == "length"
    assert stub.requests[-1]["max_tokens"] == 5
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(sess, "more")
    rows = sess.close().to_pylist()
    assert sess.end_reason == "max_tokens" and sess.metrics["completion_tokens"] == 5
    assert rows[0]["end_reason"] == "max_tokens" and sum(rows[0]["loss_mask"]) == 5

    # deadline: counted from the opening.
    sess = tap.open_session(limits={"deadline_s": 0.3})
    chat(sess, "quick")
    time.sleep(0.4)
    with pytest.raises(openai.BadRequestError, match="deadline"):
        chat(sess, "late")
    sess.close()
    assert sess.end_reason == "deadline" and sess.metrics["calls"] == 1

    # A closed session's calls are refused too: its rows are written.
    with pytest.raises(openai.BadRequestError, match="closed by the trainer"):
        chat(sess, "after close")


def test_two_instances_in_one_process_plain_and_asyncio(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    async def main() -> list[str]:
        async with await AsyncAgentTap.start(
            stub.url, QWEN3, tmp_path / "b", confdir=confdir
        ) as other:
            sess: Session = await other.open_session(metadata={"task_id": "async"})
            await asyncio.to_thread(chat, sess, "from asyncio")
            table = await other.close_session(sess, 1.0)
            return [str(v) for v in table.column("session_id").to_pylist()]

    with AgentTap.start(stub.url, QWEN3, tmp_path / "a", confdir=confdir) as first:
        ids = asyncio.run(main())
        assert len(ids) == 1
        sess = first.open_session(id="plain")
        chat(sess, "from the plain one")
        assert first.sessions()[0]["metrics"]["calls"] == 1
    # Stopped cleanly: the process is gone and the open session was written on the way out.
    assert first.proc.poll() is not None
    # Its token file is gone with it; its log stays, private, outside OUT.
    assert not (first.log.parent / "token").exists() and first.log.exists()
    assert first.log.parent.stat().st_mode & 0o077 == 0
    assert not first.log.is_relative_to(tmp_path / "a")
    rows = load_threads(tmp_path / "a")
    assert [r["session_id"] for r in rows] == ["plain"]
    assert [r["session_id"] for r in load_threads(tmp_path / "b")] == ids
    for name in ("a", "b"):
        assert not list((tmp_path / name / "journal").glob("*.jsonl"))
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    assert not any(
        str(tmp_path / "a") in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
        for p in pids
        if Path(f"/proc/{p}/cmdline").exists()
    )


def test_responses_websocket_by_base_url(tap: AgentTap, stub: StubPolicy) -> None:
    """ws://HOST:PORT/sess/ID/v1/responses: Codex's WebSocket mode without proxy or CA, in the
    session; past its max_calls the next turn is an error event (status 400), not a hang."""
    import aiohttp

    sess = tap.open_session(metadata={"task_id": "ws"}, limits={"max_calls": 2})
    stub.replies.clear()
    stub.script("First.", "Second.")
    url = sess.base_urls["openai"].replace("http://", "ws://") + "/responses"

    async def converse() -> list[list[dict[str, Any]]]:
        out = []
        auth = {"Authorization": f"Bearer {sess.api_key}"}
        async with aiohttp.ClientSession() as http, http.ws_connect(url, headers=auth) as ws:
            previous = None
            for text in ["one", "two", "three"]:
                message = {"type": "response.create", "model": "gpt-5", "store": False,
                           "input": text, "previous_response_id": previous}  # fmt: skip
                await ws.send_str(json.dumps(message))
                events = []
                while True:
                    event = json.loads(await ws.receive_str(timeout=30))
                    events.append(event)
                    if event["type"] in ("response.completed", "error", "response.failed"):
                        break
                out.append(events)
                if events[-1]["type"] == "response.completed":
                    previous = events[-1]["response"]["id"]
        return out

    first, second, third = asyncio.run(converse())
    assert first[-1]["response"]["output"][0]["content"][0]["text"] == "First."
    assert second[-1]["response"]["output"][0]["content"][0]["text"] == "Second."
    assert third[-1]["type"] == "error" and third[-1]["status"] == 400
    assert "max_calls" in json.dumps(third[-1])
    rows = sess.close().to_pylist()
    assert len(rows) == 1 and rows[0]["num_turns"] == 2
    assert rows[0]["protocol"] == "openai.responses" and sess.end_reason == "max_calls"


def test_prometheus_metrics_count_calls_tokens_and_refusals(
    tap: AgentTap, stub: StubPolicy
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        req = urllib.request.Request(
            f"{tap.api_url}/metrics", headers={"Authorization": f"Bearer {tap.token}"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    assert http(f"{tap.api_url}/metrics")[0] == 401
    before = scrape()
    assert all(name.startswith("agenttap_") for name, _ in before)
    sess = tap.open_session(limits={"max_calls": 2})
    stub.replies.clear()
    stub.script("One.", "Two.")
    chat(sess, "1")
    import openai

    client = openai.OpenAI(base_url=sess.base_urls["openai"], api_key=sess.api_key, max_retries=0)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Two."
    with pytest.raises(openai.BadRequestError):
        chat(sess, "3")
    # A body the provider refuses: counted as the client's mistake, not the policy's.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc, list-item]
    live = scrape()
    sess.close()
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    chat_ok = {"protocol": "openai.chat", "outcome": "ok"}
    assert delta("agenttap_calls_total", **chat_ok) == 2
    assert delta("agenttap_calls_total", protocol="openai.chat", outcome="refused") == 1
    assert delta("agenttap_errors_total", kind="limit") == 1
    assert delta("agenttap_calls_total", protocol="openai.chat", outcome="bad_request") == 1
    assert delta("agenttap_errors_total", kind="bad_request") == 1
    assert delta("agenttap_completion_tokens_total", protocol="openai.chat") == 6  # 2 x (2 + end)
    assert delta("agenttap_prompt_tokens_total", protocol="openai.chat") > 0
    assert delta("agenttap_call_latency_seconds_count", protocol="openai.chat") == 2
    assert delta("agenttap_time_to_first_token_seconds_count", protocol="openai.chat") == 1
    assert delta("agenttap_sessions_opened_total") == 1
    assert delta("agenttap_sessions_closed_total", end_reason="max_calls") == 1
    assert live[("agenttap_sessions_live", ())] >= 1
    assert after[("agenttap_policy_up", (("backend", stub.url),))] == 1


def test_flushing_a_session_never_seen_is_a_404(tap: AgentTap, stub: StubPolicy) -> None:
    status, body = http(f"{tap.api_url}/flush?session=never-called", "POST", tap.token)
    assert status == 404 and "has seen no call of it" in body["error"]["message"]
    sess = tap.open_session(id="flushed-twice")
    chat(sess, "hello")
    first = http(f"{tap.api_url}/flush?session=flushed-twice", "POST", tap.token)
    again = http(f"{tap.api_url}/flush?session=flushed-twice", "POST", tap.token)
    assert first[0] == 200 and len(first[1]["written"]) >= 2
    assert again == (200, {"written": []})  # known, nothing new to write
    sess.close()


def test_a_proxy_mode_session_stays_visible_once_written(
    tap: AgentTap, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session nobody opened (a proxy username): GET /sessions/{id} answers after its rows
    are written, with where they went and its wall time; it counts as a session started; the
    log says when and why it was written."""
    import openai

    def started() -> float:
        req = urllib.request.Request(
            f"{tap.api_url}/metrics", headers={"Authorization": f"Bearer {tap.token}"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read().decode()
        line = next(x for x in text.splitlines() if x.startswith("agenttap_sessions_opened_total"))
        return float(line.split()[-1])

    before = started()
    port = tap.proxy_url.rpartition(":")[2]
    monkeypatch.setenv("HTTPS_PROXY", f"http://proxy-seen:x@127.0.0.1:{port}")
    monkeypatch.setenv("SSL_CERT_FILE", tap.ca_path)
    client = openai.OpenAI(api_key="sk-any", max_retries=0, timeout=60)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "seen"}])
    time.sleep(0.05)
    client.chat.completions.create(
        model="m",
        messages=[
            {"role": "user", "content": "seen"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ],
    )
    assert started() == before + 1
    status, written = http(f"{tap.api_url}/flush?session=proxy-seen", "POST", tap.token)
    assert status == 200 and written["written"]
    status, body = http(f"{tap.api_url}/sessions/proxy-seen", token=tap.token)
    assert status == 200 and not body["opened"] and body["rows"], body
    assert body["metrics"]["calls"] == 2 and body["metrics"]["wall_time_s"] > 0
    assert body["shards"] and all(Path(p).exists() for p in body["shards"])
    assert "session 'proxy-seen' written (flush)" in tap.log.read_text(errors="replace")


def test_the_banner_prints_one_line_a_shell_sources(tap: AgentTap) -> None:
    lines = [
        line
        for line in tap.log.read_text(errors="replace").splitlines()
        if line.startswith("export AGENTTAP_")
    ]
    assert len(lines) == 1, lines
    shown = subprocess.run(
        [
            "bash",
            "-c",
            f'{lines[0]}; echo "$AGENTTAP_API $AGENTTAP_TOKEN $AGENTTAP_TOKENIZER $POLICY_URL"',
        ],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    ).stdout.split()
    # POLICY_URL too: what the proxy answers from (a trainer's weight check points there).
    assert shown[:3] == [tap.api_url, tap.token, str(QWEN3.resolve())]
    assert len(shown) == 4 and shown[3].startswith(("http://", "unix:")), shown


def test_a_status_line_is_logged_while_calls_come(tap: AgentTap) -> None:
    sess = tap.open_session()
    chat(sess, "status?")
    seen = tap.log.read_text(errors="replace").count("agenttap status:")
    chat(sess, "status again?")
    deadline = time.monotonic() + 30
    while tap.log.read_text(errors="replace").count("agenttap status:") <= seen:
        assert time.monotonic() < deadline, "no status line within 30 s of a call"
        time.sleep(0.2)
    line = tap.log.read_text(errors="replace").rsplit("agenttap status:", 1)[1].splitlines()[0]
    assert "session(s) live" in line and "calls (+" in line and "tokens sampled" in line
    sess.close()


def test_a_failed_start_leaves_no_private_folder(
    stub: StubPolicy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance that cannot start (here a bad option value: mitmdump exits) raises with the
    end of its log, and its private folder (the token file and the log) is gone."""
    import tempfile

    made: list[str] = []
    real = tempfile.mkdtemp

    def recording(*args: Any, **kwargs: Any) -> str:
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recording)
    with pytest.raises(AgentTapError) as err:
        AgentTap.start(
            stub.url, QWEN3, tmp_path / "out", options={"agenttap_policy_timeout": "soon"}
        )
    assert "exited during startup" in str(err.value) and "agenttap_policy_timeout" in str(err.value)
    (private,) = [p for p in made if Path(p).name.startswith("agenttap-")]
    assert not Path(private).exists()
