"""At start, every policy server must answer and tokenize as the tokenizer given does: a wrong
URL or another model's tokenizer stops mitmdump with what to fix (capture/policy/startup.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from aiohttp import web

from capture.policy.startup import check_policy, vocab_probe_ids
from policy_server.launcher import free_port
from rewriter.template import ChatTemplate
from tests.support.paths import CAPTURE, MITMDUMP, QWEN3, QWEN25, REPO
from tests.support.proxies import agenttap_options
from tests.support.stub_vllm import StubPolicy


def start(
    policy_url: str, tokenizer: Path, confdir: Path, tmp_path: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    """mitmdump with the addon, stopped after 60 s if it did not exit by itself."""
    cmd = [
        str(MITMDUMP), "-s", str(CAPTURE), "--listen-host", "127.0.0.1", "--listen-port", str(free_port()),
        *agenttap_options(policy_url, tmp_path / "out", confdir, tokenizer, 300), *extra,
    ]  # fmt: skip
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"mitmdump kept running: {exc.stdout!r}") from None


def test_an_unreachable_policy_stops_mitmdump_naming_the_url(confdir: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = start(url, QWEN3, confdir, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"the policy server at {url} does not answer" in out
    assert "agenttap_check_policy=false" in out  # and how to start anyway


def test_another_models_tokenizer_stops_mitmdump(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    # The stub serves Qwen3's tokenizer; Qwen2.5's splits <think> into pieces.
    done = start(stub.url, QWEN25, confdir, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "does not match the model 'stub-policy'" in out and "first different at position" in out


class ShorterVocabulary(StubPolicy):
    """A policy whose tokenizer is ours but for its last id (what vLLM answers for an id past
    its vocabulary: nothing)."""

    async def _detokenize(self, request: web.Request) -> web.Response:
        ids = [i for i in (await request.json())["tokens"] if i < len(self.tok) - 1]
        return web.json_response({"prompt": self.tok.decode(ids)})


def test_a_vocabulary_that_ends_sooner_is_named() -> None:
    ours = ChatTemplate(QWEN3)
    ids = vocab_probe_ids(ours.vocab_size())
    assert ids[0] == 0 and ids[-1] == ours.vocab_size() - 1 and len(ids) == 64
    shorter = ShorterVocabulary(str(QWEN3))
    shorter.start()
    try:
        problem = check_policy(shorter.url, ours)
    finally:
        shorter.stop()
    assert problem is not None
    assert f"64 ids spread over our vocabulary of {ours.vocab_size()}" in problem
    assert "Give the folder of the served model's tokenizer" in problem


def test_the_probe_holds_every_special_token() -> None:
    ours = ChatTemplate(QWEN3)
    specials = ours.special_tokens()
    assert "<|im_start|>" in specials and "<think>" in specials and "<tool_call>" in specials
    # In id order, each one token of its own.
    ids = [ours.encode(t) for t in specials]
    assert all(len(i) == 1 for i in ids) and ids == sorted(ids)


def test_the_check_passes_a_matching_policy_and_can_be_skipped(
    stub: StubPolicy, confdir: Path, tmp_path: Path
) -> None:
    assert check_policy(stub.url, ChatTemplate(QWEN3)) is None
    # Switched off, an unreachable policy starts anyway (the user said so): the proxy listens.
    url, port = f"http://127.0.0.1:{free_port()}", free_port()
    cmd = [
        str(MITMDUMP), "-s", str(CAPTURE), "--listen-host", "127.0.0.1", "--listen-port", str(port),
        *agenttap_options(url, tmp_path / "out", confdir, QWEN3, 300), "--set", "agenttap_check_policy=false",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the proxy did not listen within 60 s"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


def test_run_proxy_refuses_an_unreachable_policy_before_anything_listens(tmp_path: Path) -> None:
    """scripts/run_proxy.sh checks the policy before it starts mitmdump: nothing ever listens
    (plain mitmdump checks when its script loads, which mitmproxy does while its listener
    starts: it binds for an instant before exiting non-zero)."""
    url = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "run_proxy.sh"), "--policy-url", url, "--tokenizer", str(QWEN3)]
        + ["--port", str(port), "--out", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "AGENTTAP_CONFDIR": str(tmp_path / "conf")},
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"the policy server at {url} does not answer" in out
    assert "proxy listening" not in out and "AGENTTAP_" not in out
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
