"""Sessions nobody can claim early and rewards nobody replaces (issue 37, item 5), through a real
mitmdump (the launcher's) answered by the stub: calls planted under an id before the trainer
opened it, by base URL and by proxy username, never join the opened session's rows, metadata,
group or reward; a rollout whose session a token holder closed with a reward of its choosing
ends ``error`` and its rows carry no reward; rows say where their reward came from."""

from __future__ import annotations

import json
import sys
import textwrap
import time
import uuid
from typing import Any

import openai
import pytest

from capture.client.launcher import AgentTap
from capture.storage.reader import load_threads
from tests.e2e.rollouts.test_control_api import chat, http

KEPT_APART = "~unopened-"


@pytest.fixture
def tap(stub_tap: AgentTap) -> AgentTap:
    return stub_tap


def rows_of(tap: AgentTap, prefix: str, rewards: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Thread rows in OUT whose session id starts with ``prefix``, per session id."""
    found: dict[str, list[dict[str, Any]]] = {}
    for row in load_threads(tap.out, rewards=rewards):
        if row["session_id"].startswith(prefix):
            found.setdefault(row["session_id"], []).append(row)
    return found


def apart_of(found: dict[str, list[dict[str, Any]]], sid: str) -> list[dict[str, Any]]:
    (name,) = [s for s in found if s.startswith(sid + KEPT_APART)]
    return found[name]


def run_rollout(tap: AgentTap, rid: str, script: str, *args: str) -> dict[str, Any]:
    """A rollout of one python agent (``script``, its argv ``args``), unsandboxed (what is under
    test is the reward, not the sandbox), scored 1 by its verifier."""
    body = {
        "agent": {"command": [sys.executable, "-c", textwrap.dedent(script), *args]},
        "prompt": "go",
        "id": rid,
        "sandbox": "none",
        "verifier": {"command": ["sh", "-c", "echo 1"]},
        "metadata": {"task_id": "claims"},
    }
    answer = tap.client.request("POST", "/rollouts", body, timeout=None)[0]
    assert isinstance(answer, dict)
    return answer


# One model call through the session's own env (proxy mode, its secret the password).
HONEST_AGENT = """
import openai
openai.OpenAI(max_retries=0, timeout=60).chat.completions.create(
    model="policy", messages=[{"role": "user", "content": "honest work"}])
"""


def test_a_base_url_call_planted_before_a_rollout_opened_its_id_never_joins_it(
    tap: AgentTap,
) -> None:
    """The issue's attack: /sess/grpo-step-2-0/... before rollout grpo-step-2 opened that id
    came back in the rollout's group with the verifier's reward 1.0."""
    rid = f"grpo-{uuid.uuid4().hex[:6]}"
    sid = f"{rid}-0"
    planted = chat(f"{tap.api_url}/sess/{sid}/openai/v1", "planted by another agent")
    assert planted.choices[0].message.content  # answered: nobody had opened the id
    result = run_rollout(tap, rid, HONEST_AGENT)
    (run,) = result["rollouts"]
    assert run["status"] == "ok" and run["reward"] == 1.0, run
    # The rollout's rows: its own call only, with the verifier's reward and its group.
    assert len(run["rows"]) == 1 and run["metrics"]["calls"] == 1
    (row,) = run["rows"]
    assert row["session_id"] == sid and row["reward"] == 1.0
    assert row["reward_source"] == "verifier"
    assert json.loads(row["metadata"])["group_id"] == rid
    found = rows_of(tap, sid)
    assert [r["reward"] for r in found[sid]] == [1.0]
    assert found[sid][0]["trained_request_ids"] == row["trained_request_ids"]
    # The planted call is kept apart: its own session id, no group, no reward.
    (kept,) = apart_of(found, sid)
    assert kept["reward"] is None and kept["metadata"] is None and kept["reward_source"] is None
    assert set(kept["trained_request_ids"]).isdisjoint(row["trained_request_ids"])
    # Once opened (closed now), the id is the rollout's: a call without its secret is refused.
    with pytest.raises(openai.AuthenticationError, match="wants its secret"):
        chat(f"{tap.api_url}/sess/{sid}/openai/v1", "too late")


def test_calls_planted_by_proxy_username_and_base_url_stay_apart_from_the_opened_session(
    tap: AgentTap, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = f"fixme-future-{uuid.uuid4().hex[:6]}"
    # A proxy-mode call under the id (any password: nobody opened it) ...
    monkeypatch.setenv("HTTPS_PROXY", tap.proxy_url.replace("://", f"://{sid}:x@"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tap.ca_path))
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    openai.OpenAI(api_key="sk-x", max_retries=0, timeout=60).chat.completions.create(
        model="gpt-5", messages=[{"role": "user", "content": "planted by proxy"}]
    )
    # ... written to shards already (an idle write would do the same) ...
    status, flushed = http(f"{tap.api_url}/flush?session={sid}", "POST", tap.token)
    assert status == 200 and flushed["written"], flushed
    # ... and a base-URL call, not written yet.
    chat(f"{tap.api_url}/sess/{sid}/openai/v1", "planted by base url")
    sess = tap.open_session(sid, metadata={"group_id": "g-claims"})
    # From now on the id wants its secret, whichever way a client comes.
    with pytest.raises(openai.AuthenticationError):
        chat(f"{tap.api_url}/sess/{sid}/openai/v1", "planted after the open")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="sk-x", max_retries=0, timeout=60).chat.completions.create(
            model="gpt-5", messages=[{"role": "user", "content": "proxy, after the open"}]
        )
    answer = chat(sess, "the trainer's own call")
    rows = sess.close(reward=1.0).to_pylist()
    assert len(rows) == 1 and rows[0]["reward"] == 1.0 and rows[0]["reward_source"] == "close"
    assert json.loads(rows[0]["metadata"]) == {"group_id": "g-claims"}
    assert json.loads(rows[0]["metrics"])["calls"] == 1
    assert answer.choices[0].message.content
    found = rows_of(tap, sid)
    assert [r["reward"] for r in found[sid]] == [1.0]
    # Both planted calls: under the kept-apart name (the flushed shard rewritten), unrewarded.
    kept = apart_of(found, sid)
    assert len(kept) == 2 and all(r["reward"] is None and r["metadata"] is None for r in kept)
    planted_ids = {i for r in kept for i in r["trained_request_ids"]}
    assert planted_ids.isdisjoint(rows[0]["trained_request_ids"])
    # A late reward for the opened session reaches its rows only.
    sess.reward(0.5)
    found = rows_of(tap, sid)
    assert [(r["reward"], r["reward_source"]) for r in found[sid]] == [(0.5, "late")]
    assert all(r["reward"] is None for r in apart_of(found, sid))
    # The kept-apart session answers GET /sessions/ID with its rows.
    name = next(s for s in found if s.startswith(sid + KEPT_APART))
    status, got = http(f"{tap.api_url}/sessions/{name}", token=tap.token)
    assert status == 200 and len(got["rows"]) == 2, got


TOKEN_THIEF = """
import json, os, sys, urllib.request
import openai
openai.OpenAI(max_retries=0, timeout=60).chat.completions.create(
    model="policy", messages=[{"role": "user", "content": "hi"}])
api, token, sid = sys.argv[1], sys.argv[2], os.environ["AGENTTAP_SESSION"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for path, body in [("close", {"reward": 42}), ("reward", {"reward": 43})]:
    request = urllib.request.Request(
        f"{api}/sessions/{sid}/{path}", json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    print(path, opener.open(request, timeout=60).status, flush=True)
"""


def test_a_rollout_whose_session_a_token_holder_closed_with_42_ends_error_without_reward(
    tap: AgentTap,
) -> None:
    """The issue's attack: with a stolen token, POST /sessions/<own>/close {"reward": 42} then
    exit: the rollout's answer said 0.0, the shards held 42.0."""
    rid = f"stolen-{uuid.uuid4().hex[:6]}"
    sid = f"{rid}-0"
    began = time.time()
    result = run_rollout(tap, rid, TOKEN_THIEF, tap.api_url, tap.token)
    (run,) = result["rollouts"]
    assert "close 200" in run["agent_output"] and "reward 200" in run["agent_output"], run
    assert run["status"] == "error" and run["finish_reason"] == "error", run
    assert run["reward"] is None
    assert "closed through the control API with reward 42.0" in run["error"], run["error"]
    assert "1 late reward" in run["error"] and "its rows carry no reward" in run["error"]
    assert run["rows"] and all(r["reward"] is None for r in run["rows"])
    # Nowhere a reward: not in the shards as written, not with the late rewards joined.
    for rewards in (False, True):
        rows = rows_of(tap, sid, rewards=rewards)[sid]
        assert [(r["reward"], r["reward_source"]) for r in rows] == [(None, None)], rewards
    assert time.time() - began < 60


def test_rows_say_where_their_reward_came_from(tap: AgentTap) -> None:
    rid = f"sourced-{uuid.uuid4().hex[:6]}"
    (run,) = run_rollout(tap, rid, HONEST_AGENT)["rollouts"]
    assert run["status"] == "ok", run
    assert [(r["reward"], r["reward_source"]) for r in run["rows"]] == [(1.0, "verifier")]
    closed = tap.open_session()
    chat(closed, "closed with a reward")
    assert closed.close(reward=0.25).column("reward_source").to_pylist() == ["close"]
    late = tap.open_session()
    chat(late, "rewarded late")
    assert late.close().column("reward_source").to_pylist() == [None]
    late.reward(2.0)
    assert late.rows().column("reward_source").to_pylist() == ["late"]
    read = {r["session_id"]: (r["reward"], r["reward_source"]) for r in load_threads(tap.out)}
    assert read[f"{rid}-0"] == (1.0, "verifier")
    assert read[closed.id] == (0.25, "close") and read[late.id] == (2.0, "late")


def test_a_websocket_opened_before_the_id_gets_no_turn_once_it_is_opened(tap: AgentTap) -> None:
    """Codex's WebSocket mode by base URL: a socket let in while nobody had opened its id is
    refused every turn it sends once the trainer opened the id (a 401 error event)."""
    import asyncio

    import aiohttp

    sid = f"ws-early-{uuid.uuid4().hex[:6]}"
    url = f"{tap.api_url.replace('http://', 'ws://')}/sess/{sid}/v1/responses"
    opened: list[Any] = []

    async def converse() -> list[dict[str, Any]]:
        last = []
        auth = {"Authorization": "Bearer sk-anything"}
        async with aiohttp.ClientSession() as http, http.ws_connect(url, headers=auth) as ws:
            for text in ["before the open", "after the open"]:
                message = {"type": "response.create", "model": "gpt-5", "store": False,
                           "input": text}  # fmt: skip
                await ws.send_str(json.dumps(message))
                while True:
                    event = json.loads(await ws.receive_str(timeout=30))
                    if event["type"] in ("response.completed", "error", "response.failed"):
                        break
                last.append(event)
                if not opened:
                    opened.append(await asyncio.to_thread(tap.open_session, sid))
        return last

    before, after = asyncio.run(converse())
    assert before["type"] == "response.completed", before
    assert after["type"] == "error" and after["status"] == 401, after
    assert "wants its secret" in json.dumps(after)
    (sess,) = opened
    assert sess.close().num_rows == 0  # the opened session has nothing of the socket's
    (kept,) = apart_of(rows_of(tap, sid), sid)
    assert kept["reward"] is None and kept["protocol"] == "openai.responses"


def test_a_base_url_body_sent_slowly_across_the_opening_is_refused(tap: AgentTap) -> None:
    """A call whose head comes before the trainer opens its id and whose body comes after: the
    secret is checked once the body is in, so it is refused, never recorded in the session."""
    import socket

    sid = f"slow-{uuid.uuid4().hex[:6]}"
    body = json.dumps({"model": "gpt-5", "messages": [{"role": "user", "content": "slow"}]})
    host, port = tap.api_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /sess/{sid}/openai/v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer sk-x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
        )
        sock.sendall(head.encode())
        # 100 Continue: the head is in and its handler running, waiting for the body.
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body[:10].encode())
        sess = tap.open_session(sid)
        sock.sendall(body[10:].encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 401 " in status_line, answer[:300]
    assert b"wants its secret" in rest
    assert sess.close().num_rows == 0 and sess.metrics is not None
    assert sess.metrics["calls"] == 0
    assert sid not in rows_of(tap, sid)
