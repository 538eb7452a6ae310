"""Real ``mitmdump`` processes running the addon, as the tests start them (``start_proxy``), and
reading what they recorded; the check of the real vLLM's rows against the trainer's forward."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from capture.options import all_options
from policy_server import launcher as policy_server
from tests.support.paths import CAPTURE, MITMDUMP, QWEN3, REPO, TRAIN_PYTHON

# A token every this many seconds: slower than agenttap_stream_flush_ms's default, so a proxy that
# keeps up sends each token as its own event (the tests that count events per token pace so).
ONE_EVENT_PER_TOKEN_S = (
    next(int(o.default) for o in all_options() if o.name == "agenttap_stream_flush_ms") / 1000
    + 0.05
)

# OUT folders of the proxies each session-wide real vLLM answered (start_proxy records them).
_VLLM_OUTS: dict[str, list[Path]] = {}
# Their summaries, printed at the end of the run (pytest_terminal_summary).
ROW_CHECKS: list[str] = []


def check_recorded_rows(model: Path, outs: list[Path]) -> None:
    """The trainer's fp32 forward (tests/support/check_rows.py, in .venv-train) over every row
    the real-vLLM tests recorded: their trained tokens' logprobs must be the policy's."""
    if not outs:
        return
    if not TRAIN_PYTHON.exists():
        pytest.fail(f"{TRAIN_PYTHON} is missing: scripts/setup.sh builds it (setup_train.sh)")
    script = REPO / "tests" / "support" / "check_rows.py"
    done = subprocess.run(
        [str(TRAIN_PYTHON), str(script), str(model), *map(str, outs)],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    ROW_CHECKS.append(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "")
    if done.returncode != 0:
        pytest.fail(
            f"rows whose logprobs are not the policy's:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
        )


def processes_with(fragment: bytes) -> list[int]:
    """Pids of the processes whose command line holds ``fragment`` (args joined by spaces,
    each followed by one)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if fragment in cmdline:
            found.append(int(pid))
    return found


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mitmdump exited early:\n{log.read_text()[-4000:]}")
        text = log.read_text(errors="replace")
        # The ready line (or its refusal) ends the start-up: a connection before it would be
        # logged in the middle of the start-up lines (tests/e2e/ops/test_call_log.py).
        if "agenttap ready:" in text or "agenttap: not ready" in text:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
        time.sleep(0.2)
    raise RuntimeError(f"mitmdump not ready:\n{log.read_text()[-4000:]}")


@dataclass
class Proxy:
    port: int
    out: Path
    ca: Path
    log: Path
    proc: subprocess.Popen[bytes]
    # The control API's token (every route but /healthz and /ready wants it, /flush too).
    token: str = ""

    def env(self, session: str) -> dict[str, str]:
        return {
            "HTTPS_PROXY": f"http://{session}:x@127.0.0.1:{self.port}",
            "SSL_CERT_FILE": str(self.ca),
        }

    def openai(self, session: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
        """The real openai SDK, configured only through the environment."""
        import openai

        for key, value in self.env(session).items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
        return openai.OpenAI(api_key="sk-agenttap-test-key", max_retries=0, timeout=120)

    def anthropic(self, session: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
        """The real anthropic SDK, configured only through the environment."""
        import anthropic

        for key, value in self.env(session).items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
        return anthropic.Anthropic(api_key="sk-ant-agenttap-test-key", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def flush(self, session: str | None = None) -> list[str]:
        """Have the proxy write the session's shards now (all sessions: None); its paths. A
        stopped proxy wrote everything when it stopped."""
        if self.proc.poll() is not None:
            return []
        query = "?" + urllib.parse.urlencode({"session": session}) if session is not None else ""
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{self.port}"})
        )
        req = urllib.request.Request(
            f"http://agenttap.local/flush{query}",
            data=b"",
            method="POST",
            headers={"Authorization": f"Bearer {self.token or proxy_token(self.log)}"},
        )
        try:
            with opener.open(req, timeout=60) as resp:
                return list(json.load(resp)["written"])
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and session is not None:
                return []  # the proxy never saw a call of it: nothing to write
            raise

    def turns(self, session: str | None = None, expect: int = 1, **_: object) -> list[dict]:
        """Rows of the per-call shards, after flushing the session (fails under ``expect``)."""
        self.flush(session)
        rows = read_turns(self.out, session)
        assert len(rows) >= expect, f"expected {expect} turn rows for {session!r}, got {len(rows)}"
        return rows

    def threads(self, session: str | None = None, expect: int = 1, **_: object) -> list[dict]:
        """Rows of the thread shards, after flushing the session (fails under ``expect``)."""
        self.flush(session)
        rows = read_threads(self.out, session)
        assert len(rows) >= expect, (
            f"expected {expect} thread rows for {session!r}, got {len(rows)}"
        )
        return rows


def record_turn(
    store: Any, session: str, chat: Any, ids: list[int], i: int, text: str | None = None
) -> None:
    """Assemble ``chat`` in ``store`` and record call ``r{i}`` answering ``ids`` (text
    ``answer {i}`` unless given), as the gateway would after vLLM answered."""
    from capture.storage.records import TurnRecord
    from rewriter.canonical import Message

    assembly = store.assemble(session, chat)
    record = TurnRecord(
        session_id=session, request_id=f"r{i}", turn_index=i, protocol="openai.chat",
        requested_model="m", policy_model="p", backend="b", user_agent="ua",
        prompt_ids=assembly.prompt_ids, completion_ids=ids, completion_logprobs=[-0.5] * len(ids),
        finish_reason="stop", response_finish_reason="stop", started_at=0.0, latency_s=0.1, stream=False,
    )  # fmt: skip
    store.record(
        record, assembly, Message("assistant", text if text is not None else f"answer {i}")
    )


def _read_shards(folder: Path, session: str | None) -> list[dict]:
    if not folder.exists() or not any(folder.glob("*.parquet")):
        return []
    rows = ds.dataset(str(folder), format="parquet").to_table().to_pylist()
    return [r for r in rows if session is None or r["session_id"] == session]


def read_turns(out: Path, session: str | None = None) -> list[dict]:
    return sorted(_read_shards(out / "turns", session), key=lambda r: r["turn_index"])


def read_threads(out: Path, session: str | None = None) -> list[dict]:
    return _read_shards(out / "threads", session)


def proxy_token(log: Path) -> str:
    """The control API's token as the proxy printed it at start (``AGENTTAP_TOKEN=``)."""
    for line in log.read_text(errors="replace").splitlines():
        _, found, token = line.partition("AGENTTAP_TOKEN=")
        if found:
            return token.split()[0]
    raise AssertionError(f"no AGENTTAP_TOKEN= line in {log}")


def agenttap_options(
    policy_url: str, out: Path, confdir: Path, tokenizer: Path, idle_timeout: int
) -> list[str]:
    """The mitmdump ``--set`` arguments every test proxy (live or replaying) runs with."""
    return [
        "--set", f"confdir={confdir}",
        "--set", f"agenttap_policy_url={policy_url}",
        "--set", f"agenttap_tokenizer={tokenizer}",
        "--set", f"agenttap_out={out}",
        "--set", f"agenttap_idle_timeout={idle_timeout}",
    ]  # fmt: skip


def start_proxy(
    policy_url: str,
    out: Path,
    confdir: Path,
    tokenizer: Path = QWEN3,
    extra: list[str] | None = None,
    idle_timeout: int = 3600,
) -> Proxy:
    for url, outs in _VLLM_OUTS.items():
        if policy_url.split(",")[0].rstrip("/") == url:
            outs.append(out)  # its rows are checked against the trainer's forward at the end
    port = policy_server.free_port()
    log = out.parent / f"{out.name}-mitmdump.log"
    cmd = [
        str(MITMDUMP), "-s", str(CAPTURE),
        "--listen-host", "127.0.0.1", "--listen-port", str(port),
        *agenttap_options(policy_url, out, confdir, tokenizer, idle_timeout),
        *(extra or []),
    ]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait_port(port, proc, log)
    except RuntimeError:
        proc.kill()
        proc.wait()
        raise
    return Proxy(port=port, out=out, ca=confdir / "mitmproxy-ca-cert.pem", log=log, proc=proc)
