"""Issue 18: the log lines a person reads, built without a proxy: a recorded call's one line, the
embedded policy's progress read from vLLM's log, the per-client-family start-up lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture.control.banner import ready_line, start_lines
from capture.control.endpoints import Endpoints
from capture.pipeline.recording import call_line, failed_line, log_field
from capture.storage.records import FailedCall, TurnRecord
from policy_server.launcher import last_log_step


def _record(**changes: object) -> TurnRecord:
    fields: dict[str, object] = dict(
        session_id="s1",
        request_id="resp_1",
        turn_index=0,
        protocol="openai.responses",
        requested_model="gpt-5",
        policy_model="p",
        backend="http://127.0.0.1:8000",
        user_agent="",
        prompt_ids=list(range(1234)),
        completion_ids=list(range(56)),
        completion_logprobs=[0.0] * 56,
        finish_reason="stop",
        response_finish_reason="completed",
        started_at=0.0,
        latency_s=0.4123,
        stream=True,
    )
    fields.update(changes)
    return TurnRecord(**fields)  # type: ignore[arg-type]


def test_call_line() -> None:
    assert call_line(_record()) == (
        "agenttap call: session=s1 openai.responses resp_1 1234+56 tokens stop 0.41 s "
        "via http://127.0.0.1:8000"
    )


def _failed(reason: str) -> FailedCall:
    return FailedCall(
        session_id="s1",
        request_id="chatcmpl-1",
        protocol="openai.chat",
        requested_model="m",
        policy_model="p",
        backend="http://127.0.0.1:8000",
        user_agent="",
        stream=True,
        reason=reason,
        policy_status=0,
        prompt_tokens=900,
        completion_tokens=12,
        started_at=100.0,
        failed_at=102.5,
    )


def test_failed_line() -> None:
    assert failed_line(_failed("the policy server stopped sending")) == (
        "agenttap call failed: session=s1 openai.chat chatcmpl-1 900+12 tokens after 2.50 s "
        "via http://127.0.0.1:8000: the policy server stopped sending"
    )


def test_a_client_chosen_name_cannot_break_the_line() -> None:
    assert log_field("codex:1b2c") == "codex:1b2c"
    assert log_field("two words\nagenttap call: forged") == '"two words\\nagenttap call: forged"'
    assert log_field("") == '""'
    line = call_line(_record(session_id="a b\nc"))
    assert "\n" not in line and 'session="a b\\nc" ' in line
    # The policy's error may quote what the client sent: it stays on the line too.
    line = failed_line(_failed("bad stop 'x\nagenttap call: forged\u2028'"))
    assert line.endswith("bad stop 'x\\nagenttap call: forged\\u2028'"), line


VLLM_LOG = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(APIServer pid=10102) INFO 11-25 04:34:29 [api_utils.py:347]        \u2588     \u2588     \u2588\u2584
(APIServer pid=10102) INFO 11-25 04:34:36 [model.py:2152] Using max model len 32768
(Worker pid=10133) INFO 11-25 04:34:53 [default_loader.py:501] Loading weights took 0.33 seconds
(Worker pid=10133) WARNING 11-25 04:34:52 [cpu_worker.py:114] libiomp is not found in LD_PRELOAD.
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  3.11it/s]
  warnings.warn(

"""


def test_progress_is_the_last_step_vllm_logged(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    assert last_log_step(log) == ""  # not written yet
    log.write_text(VLLM_LOG)
    assert last_log_step(log) == "Loading weights took 0.33 seconds"
    with open(log, "a") as out:
        out.write(
            "(Worker pid=1) INFO 11-25 04:34:54 [cpu_model_runner.py:87] Warming up model for "
            "the compilation...\n(EngineCore pid=2) INFO 11-25 04:35:13 [kv_cache_utils.py:2327]"
            " CPU KV cache size: 2,097,152 tokens" + " x" * 200 + "\n"
        )
    step = last_log_step(log)
    assert step.startswith("CPU KV cache size: 2,097,152 tokens") and len(step) == 120
    # A message's indented continuation lines and the list of routes say nothing of progress.
    with open(log, "a") as out:
        out.write(
            "(APIServer pid=3) INFO 11-25 04:35:17 [entry.py:140] Starting vLLM server on "
            "http://127.0.0.1:42439\n"
            "(APIServer pid=3) INFO 11-25 04:35:17 [launcher.py:195] Route: /v1/models, Methods: "
            "GET\n(EngineCore pid=2) INFO 11-25 04:35:18 [omp.py:185] \treserved_cpus=[1]\n"
        )
    assert last_log_step(log) == "Starting vLLM server on http://127.0.0.1:42439"
    assert last_log_step(None) == ""


def test_one_export_line_per_client_family_in_place_of_the_generic_ones() -> None:
    ends = Endpoints(
        api_url="http://127.0.0.1:8081",
        proxy_url="http://127.0.0.1:8080",
        ca_path="/c/mitmproxy-ca-cert.pem",
        bundle_path="/c/agenttap-ca-bundle.pem",
    )
    banner = [
        "AGENTTAP_PROXY=http://127.0.0.1:8080",
        "Proxy mode: HTTPS_PROXY=... SSL_CERT_FILE=...",
        "API keys: any value works",
        "Base-URL mode (SESSION: any name you pick):",
    ]
    lines = start_lines(banner, ends)
    assert lines[0] == banner[0] and lines[-1] == banner[-1]
    assert not [line for line in lines if line.startswith(("Proxy mode:", "API keys:"))]
    exports = [line.strip() for line in lines if line.strip().startswith("export ")]
    proxy = "HTTPS_PROXY=http://SESSION:x@127.0.0.1:8080"
    assert exports == [
        f"export {proxy} NODE_EXTRA_CA_CERTS=/c/mitmproxy-ca-cert.pem "
        "ANTHROPIC_API_KEY=sk-ant-agenttap GEMINI_API_KEY=agenttap",
        f"export {proxy} SSL_CERT_FILE=/c/agenttap-ca-bundle.pem "
        "CODEX_CA_CERTIFICATE=/c/agenttap-ca-bundle.pem OPENAI_API_KEY=sk-agenttap",
        f"export {proxy} SSL_CERT_FILE=/c/agenttap-ca-bundle.pem OPENAI_API_KEY=sk-agenttap "
        "ANTHROPIC_API_KEY=sk-ant-agenttap GOOGLE_API_KEY=agenttap",
        f"export {proxy} SSL_CERT_FILE=/c/agenttap-ca-bundle.pem OPENAI_API_KEY=sk-agenttap "
        "LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_CONFIGURED=true LLM_MODEL=openai/gpt-4o "
        "LLM_API_KEY=anything",
    ]
    # No proxy address known: nothing to export, the rest as it was.
    unknown = Endpoints(api_url="http://127.0.0.1:8081", proxy_url="", ca_path="/c/ca.pem")
    assert start_lines(banner, unknown) == [banner[0], banner[3]]


def test_ready_line() -> None:
    assert ready_line(
        "http://127.0.0.1:8080", {"api.openai.com", "api.anthropic.com"}, ["http://p:8000"]
    ) == (
        "agenttap ready: proxy http://127.0.0.1:8080 answering api.anthropic.com, "
        "api.openai.com from http://p:8000"
    )


def test_a_policy_start_past_its_limit_names_the_option(tmp_path: Path) -> None:
    """vLLM still starting when the limit passes: the error says where it was and which option
    gives it longer (issue 51: a loaded machine ran past a fixed 300 s)."""
    import subprocess
    import sys

    from policy_server.launcher import PolicyServerError, wait_ready

    log = tmp_path / "vllm.log"
    log.write_text("INFO 11-29 10:00:00 [loader.py:1] Loading weights took 0.33 seconds\n")
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(PolicyServerError) as err:
            wait_ready("http://127.0.0.1:9", waiting, timeout_s=0.5, log_path=log)
    finally:
        waiting.kill()
        waiting.wait()
    words = str(err.value)
    assert "not ready after 0 s (last: Loading weights took 0.33 seconds)" in words, words
    assert "--start-timeout SECONDS" in words and "AGENTTAP_POLICY_START_S" in words
