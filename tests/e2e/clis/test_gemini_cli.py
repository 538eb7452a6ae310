"""The real Gemini CLI through the real proxy, answered by a scripted policy and by the real vLLM
tiny model. Gemini CLI is installed by scripts/install_clients.sh (scripts/setup.sh runs it).

Gemini CLI runs as it would for a user: only HTTPS_PROXY (with the session as the proxy
username), NODE_EXTRA_CA_CERTS, an API key and GEMINI_CLI_TRUST_WORKSPACE are set; HOME is fresh.
Before its main call it asks a small model to rate the task (a ``generateContent`` call with a
``responseJsonSchema``): the policy answers it under vLLM's structured outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.e2e.providers.test_trajectory_vllm import _assert_exact, _rescore
from tests.support.flows import (
    read_flows,
    recorded_replies,
    recording,
    replay_flows,
    thread_signatures,
)
from tests.support.paths import IM_END, REPO
from tests.support.proxies import Proxy
from tests.support.stub_vllm import StubPolicy

GEMINI = REPO / ".cache" / "node" / "node_modules" / ".bin" / "gemini"
HOST = "generativelanguage.googleapis.com"


@pytest.fixture(scope="module")
def gemini_cli() -> Path:
    assert GEMINI.exists(), f"Gemini CLI is not installed at {GEMINI}: run scripts/setup.sh"
    return GEMINI


def run_gemini(
    gemini: Path, proxy: Proxy, session: str, workdir: Path, prompt: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    home = workdir.parent / f"{workdir.name}-home"
    home.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GEMINI_API_KEY": "AIza-agenttap-test-key",
        # Without it a non-interactive run in an untrusted folder exits with code 55.
        "GEMINI_CLI_TRUST_WORKSPACE": "true",
        "HTTPS_PROXY": f"http://{session}:x@127.0.0.1:{proxy.port}",
        "NODE_EXTRA_CA_CERTS": str(proxy.ca),
    }
    return subprocess.run(
        [str(gemini), "-p", prompt, "--yolo"],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def example(schema: dict[str, Any]) -> Any:
    """A value valid under ``schema``: what a policy under structured outputs would write."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {k: example(v) for k, v in schema.get("properties", {}).items()}
    return {"integer": 10, "number": 10, "boolean": False, "array": []}.get(str(kind), "simple")


def answer_router(body: dict[str, Any]) -> str | None:
    """The stub's rule for the router call (the only call with structured outputs)."""
    if "structured_outputs" not in body:
        return None
    return json.dumps(example(body["structured_outputs"]["json"]))


def test_file_writing_task_with_scripted_policy(
    gemini_cli: Path, stub_proxy: Proxy, stub: StubPolicy, tok: Any, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    target = workdir / "hello.txt"
    # Thoughts reach Gemini CLI as `thought` parts (it asks for them) and are not sent back.
    call = "<think>\nI should write the file.\n</think>\n\nI'll create the file.\n" + hermes(
        "write_file", {"file_path": str(target), "content": "hi"}
    )
    stub.replies.clear()
    stub.script(call, "Done: hello.txt holds hi.")
    stub.rules.append(answer_router)
    n = len(stub.requests)
    session = "gemini-cli-stub"
    try:
        done = run_gemini(gemini_cli, stub_proxy, session, workdir, "Create hello.txt with hi")
    finally:
        stub.rules.remove(answer_router)
    assert done.returncode == 0, done.stdout + done.stderr
    assert target.read_text() == "hi"
    assert "I'll create the file." in done.stdout and "Done: hello.txt holds hi." in done.stdout
    assert not stub.replies, "Gemini CLI did not make both main calls"

    # The router call: Gemini CLI's schema (upper-case OpenAPI types in responseJsonSchema)
    # reached vLLM as a JSON schema, and it accepted the schema-valid answer (no retry).
    routers = [r for r in stub.requests[n:] if "structured_outputs" in r]
    assert len(routers) == 1, f"{len(routers)} router calls: the answer was not accepted"
    schema = routers[0]["structured_outputs"]["json"]
    assert schema["type"] == "object" and schema["properties"]
    assert all(p["type"].islower() for p in schema["properties"].values())

    turns = stub_proxy.turns(session, expect=3)
    # Every generation is a turn (the router answer's re-score is not a generation).
    generations = [r for r in stub.requests[n:] if r.get("prompt_logprobs") is None]
    assert len(turns) == 3 == len(generations)
    assert {t["protocol"] for t in turns} == {"gemini.generate_content"}
    assert all(t["user_agent"].startswith("GeminiCLI") for t in turns)
    rows = stub_proxy.threads(session, expect=2)
    assert len(rows) == 2
    main = max(rows, key=lambda r: r["num_turns"])
    assert main["num_turns"] == 2
    main_turns = [t for t in turns if t["thread_id"] == main["thread_id"]]
    assert [json.loads(t["metadata"])["assembly"] for t in main_turns] == ["new", "extend"]
    assert all(t["stream"] for t in main_turns)  # :streamGenerateContent?alt=sse
    # Gemini CLI sends the function call back with a thoughtSignature and the result with the
    # call's id: call 2's prompt is call 1's prompt plus the sampled ids, exactly.
    first, second = main_turns
    sampled = list(tok.encode(call, add_special_tokens=False)) + [IM_END]
    assert first["completion_ids"] == sampled
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(sampled)] == (
        first["prompt_ids"] + sampled
    )
    assert 2 not in main["provenance"] and 3 not in main["provenance"]
    assert "Successfully created and wrote to new file" in tok.decode(second["prompt_ids"])
    assert "thought_signature" not in tok.decode(second["prompt_ids"])
    (router,) = [r for r in rows if r is not main]
    assert router["num_turns"] == 1 and router["thread_id"] != main["thread_id"]


def test_recorded_gemini_cli_traffic_replays_offline(
    gemini_cli: Path, stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    """Gemini CLI's own traffic, recorded once as a flow file, replayed through the addon with
    no Gemini CLI and no network: the same threads come out."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    target = workdir / "hello.txt"
    call = hermes("write_file", {"file_path": str(target), "content": "hi"})
    flow_file, live, replayed = tmp_path / "gemini.flows", tmp_path / "live", tmp_path / "replayed"
    session = "gemini-cli-replay"
    stub.replies.clear()
    stub.script(call, "Done.")
    stub.rules.append(answer_router)
    try:
        with recording(stub.url, live, confdir, flow_file) as proxy:
            done = run_gemini(gemini_cli, proxy, session, workdir, "Create hello.txt with hi")
    finally:
        stub.rules.remove(answer_router)
    assert done.returncode == 0, done.stdout + done.stderr
    assert target.read_text() == "hi"
    flows = [f for f in read_flows(flow_file) if f.request.host == HOST]
    paths = [f.request.path for f in flows]
    assert len(paths) == 3, paths
    assert sum(p.endswith(":streamGenerateContent?alt=sse") for p in paths) == 2
    # The API key (x-goog-api-key) is not in the saved flows.
    assert all("x-goog-api-key" not in f.request.headers for f in flows)
    assert b"AIza" not in flow_file.read_bytes()

    replies = recorded_replies(live, session)
    assert len(replies) == 3 and replies[1:] == [call, "Done."]
    # Replayed one after the other in recorded order: the script answers all three.
    stub.replies.clear()
    stub.script(*replies)
    replay = replay_flows(flow_file, stub.url, replayed, confdir)
    assert replay.returncode == 0, replay.log[-4000:]
    assert replay.dials and all(d.startswith("loopback 127.0.0.1:") for d in replay.dials)
    assert not stub.replies, "not every recorded call was replayed"
    want, got = thread_signatures(live, session), thread_signatures(replayed, session)
    assert sorted(w["num_turns"] for w in want) == [1, 2]
    assert got == want


@pytest.mark.vllm
def test_gemini_cli_against_the_real_policy(
    gemini_cli: Path, vllm_proxy: Proxy, vllm_url: str, tmp_path: Path
) -> None:
    # What Gemini CLI does after its router call depends on what the random policy says
    # (unseeded): once in a CI run it closed its main streams at once and exited 0, leaving
    # only the router call recorded. A second run (a new session) settles that case; both
    # runs must exit cleanly.
    for attempt in (1, 2):
        workdir = tmp_path / f"work-{attempt}"
        workdir.mkdir()
        session = f"gemini-cli-vllm-{attempt}"
        done = run_gemini(gemini_cli, vllm_proxy, session, workdir, "Say hello.")
        # The random policy answers text (or something that parses as text): Gemini CLI prints
        # it and ends cleanly; its router call got schema-valid JSON from structured outputs.
        assert done.returncode == 0, done.stdout + done.stderr
        turns = vllm_proxy.turns(session, expect=1, timeout=60)
        if len(turns) >= 2:
            break
        print(f"attempt {attempt}: Gemini CLI made {len(turns)} recorded call(s); again")
    assert len(turns) >= 2, [t["requested_model"] for t in turns]
    # The router call is Gemini CLI's only generateContent call; its main calls all stream.
    router = [t for t in turns if not t["stream"]]
    assert router and len(router) < len(turns), [t["requested_model"] for t in turns]
    for t in router:
        json.loads(t["completion_text"])
    rows = vllm_proxy.threads(session, expect=2)
    router_threads = {t["thread_id"] for t in router}
    free = [r for r in rows if r["thread_id"] not in router_threads]
    assert free and len(free) + len(router_threads) == len(rows)
    for row in free:
        # Gemini CLI's prompt is ~8.5k tokens: see _assert_exact on fp32 at long context.
        assert _assert_exact(row, turns, vllm_url, tolerance=1e-5) <= 1e-5
    # The router call was sampled under a JSON-schema grammar: vLLM's logprobs are those of the
    # grammar-masked distribution (never below the model's own). The turns shard keeps them as
    # vLLM returned them; the thread row trains the policy's own logprobs (a re-score,
    # provenance 2), so every exported trained logprob equals vLLM's re-score.
    for t in router:
        assert json.loads(t["metadata"])["constrained"] == "json_schema"
    for row in rows:
        if row["thread_id"] not in router_threads:
            continue
        trained = [p for p, m in zip(row["provenance"], row["loss_mask"], strict=True) if m]
        # Masked (provenance 3) only where the re-score failed: the proxy's log says why.
        why = [
            line
            for line in vllm_proxy.log.read_text(errors="replace").splitlines()
            if "re-score" in line or "prompt_logprobs" in line
        ]
        assert trained and set(trained) == {2}, (sorted(set(row["provenance"])), why[-5:])
        assert _assert_exact(row, turns, vllm_url, tolerance=1e-5) <= 1e-5
        (t,) = [t for t in router if t["thread_id"] == row["thread_id"]]
        rescored = _rescore(vllm_url, row["input_ids"])
        start = len(t["prompt_ids"])
        gaps = [
            float(np.float32(lp) - np.float32(r))
            for lp, r in zip(t["completion_logprobs"], rescored[start:], strict=True)
        ]
        assert gaps and min(gaps) >= -1e-5, min(gaps)
        print(
            f"router call: {len(gaps)} constrained tokens, sampler minus policy up to {max(gaps):.3f} nats"
        )
