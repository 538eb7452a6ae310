"""New weights through agenttap (``POST /policy/weights``) into the real vLLM (fp32 tiny Qwen3):
the calls after the update are sampled by the new weights (their logprobs equal the HF forward
of the new weights, and differ from the old weights'), a generation streaming during the update
goes on without a break and carries two weight spans, each equal to its own weights' forward.

The shared vLLM gets its original weights back at the end (pushed the same way), so the other
tests of the session see the policy they expect.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policy_server import launcher
from tests.e2e.policy.test_abort_resume_vllm import LongStream, stream_long_story
from tests.support.paths import QWEN3, REPO
from tests.support.proxies import Proxy, proxy_token, start_proxy
from tests.support.warm_python import warm

# It changes the session's vLLM for everyone: no other test may use it meanwhile.
pytestmark = [pytest.mark.vllm, pytest.mark.policy_exclusive]

HF_PYTHON = launcher.VLLM_PYTHON  # torch + transformers live there, not in the proxy's
STREAM_TOKENS = 1200
UPDATE_AFTER_CHUNKS = 20
ATTEMPTS = 3


def control(proxy: Proxy, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """A control API call through the proxy (http://agenttap.local), with the token."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{proxy.port}"})
    )
    req = urllib.request.Request(
        f"http://agenttap.local{path}",
        data=json.dumps(body).encode() if body is not None else None,
        method=method,
        headers={"Authorization": f"Bearer {proxy_token(proxy.log)}"},
    )
    try:
        with opener.open(req, timeout=300) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def hf(*args: str, stdin: Any = None) -> Any:
    # In a warm interpreter (torch imported once: tests/support/warm_python.py).
    done = warm(HF_PYTHON).run(
        REPO / "tests" / "support" / "hf_score.py",
        *args,
        stdin=json.dumps(stdin) if stdin is not None else None,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout) if args[0] == "score" else None


def max_diff(row: dict[str, Any], scores: list[float], positions: list[int]) -> float:
    got = np.asarray(row["logprobs"], dtype=np.float64)[positions]
    want = np.asarray(scores, dtype=np.float64)[positions]
    return float(np.max(np.abs(got - want))) if positions else 0.0


def test_weights_pushed_through_agenttap_sample_the_next_calls(
    vllm_url: str, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = launcher.ensure_tiny_model(tokenizer=QWEN3)
    proxy = start_proxy(vllm_url, tmp_path / "out", confdir)
    pushed: list[str] = []
    try:
        # Bad bodies: the provider-agnostic control error, and nothing changes.
        status, body = control(proxy, "POST", "/policy/weights", {"path": "rel", "version": "x"})
        assert status == 400 and "absolute" in body["error"]["message"]
        status, body = control(
            proxy, "POST", "/policy/weights", {"path": str(tmp_path), "version": "x"}
        )
        assert status == 400 and "safetensors" in body["error"]["message"]
        assert control(proxy, "GET", "/policy/version", None)[1]["version"] == "default"

        # A stream runs while new weights are pushed; retried where the machine was so slow
        # that vLLM had sampled every token before the pause reached it.
        stream_row: dict[str, Any] | None = None
        for attempt in range(1, ATTEMPTS + 1):
            version = f"step-{attempt}"
            folder = tmp_path / version
            hf("perturb", str(original), str(folder), str(attempt))
            answers: dict[str, Any] = {}

            def push(
                folder: Path = folder, version: str = version, answers: dict[str, Any] = answers
            ) -> None:
                started = time.monotonic()
                answers["status"], answers["body"] = control(
                    proxy, "POST", "/policy/weights", {"path": str(folder), "version": version}
                )
                answers["seconds"] = time.monotonic() - started

            pusher = threading.Thread(target=push, daemon=True)
            seen = LongStream()
            session = f"across-{attempt}"
            client = proxy.openai(session, monkeypatch)
            stream_long_story(client, UPDATE_AFTER_CHUNKS, pusher.start, seen, STREAM_TOKENS)
            pusher.join(300)
            assert answers["status"] == 200, answers
            pushed.append(version)
            assert answers["body"]["version"] == version
            assert [r["ok"] for r in answers["body"]["replicas"]] == [True]
            print(f"attempt {attempt}: update took {answers['seconds']:.2f} s")
            # The client saw one ordinary stream.
            assert seen.finish == "length" and seen.usage.completion_tokens == STREAM_TOKENS
            (row,) = proxy.threads(session, expect=1)
            if len(row["weight_versions"]) == 2:
                stream_row = row
                break
        assert stream_row is not None, f"no update reached vLLM mid-stream in {ATTEMPTS} tries"
        new_version, new_folder = pushed[-1], tmp_path / pushed[-1]
        old_version = pushed[-2] if len(pushed) > 1 else "default"
        old_folder = tmp_path / old_version if len(pushed) > 1 else original
        before, after = stream_row["weight_versions"]
        assert (before["version"], after["version"]) == (old_version, new_version)
        assert before["end"] == after["start"] and after["end"] == len(stream_row["input_ids"])

        # A call after the update: the new weights sampled it.
        client = proxy.openai("after", monkeypatch)
        client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "Write a haiku about trains."}],
            max_tokens=48,
            extra_body={"ignore_eos": True},
        )
        (after_row,) = proxy.threads("after", expect=1)
        trained = [i for i, m in enumerate(after_row["loss_mask"]) if m]
        assert after_row["weight_versions"] == [
            {"version": new_version, "start": trained[0], "end": trained[-1] + 1}
        ]

        rows = [after_row["input_ids"], stream_row["input_ids"]]
        new_scores = hf("score", str(new_folder), stdin={"rows": rows})
        old_scores = hf("score", str(old_folder), stdin={"rows": rows})
        after_new = max_diff(after_row, new_scores[0], trained)
        after_old = max_diff(after_row, old_scores[0], trained)
        first = list(range(before["start"], before["end"]))
        second = list(range(after["start"], after["end"]))
        span_old = max_diff(stream_row, old_scores[1], first)
        span_new = max_diff(stream_row, new_scores[1], second)
        print(
            f"max |row - HF|: after the update {after_new:.2e} (new weights) vs {after_old:.2e} "
            f"(old); the stream's {len(first)} tokens before it {span_old:.2e} (old), its "
            f"{len(second)} after it {span_new:.2e} (new)"
        )
        assert after_new < 1e-3 and span_old < 1e-3 and span_new < 1e-3
        assert after_old > 1e-2  # the update really changed the policy
        assert control(proxy, "GET", "/policy/version", None)[1]["version"] == new_version
    finally:
        # The other tests' policy: the original weights, pushed back the same way.
        status, body = control(
            proxy, "POST", "/policy/weights", {"path": str(original), "version": "default"}
        )
        proxy.stop()
    assert status == 200, body
