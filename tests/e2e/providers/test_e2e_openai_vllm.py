"""End to end: the real openai SDK -> real mitmdump with the addon (HTTPS) -> real vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support.proxies import Proxy

pytestmark = pytest.mark.vllm


def test_non_streaming_call_is_answered_and_recorded_exactly(
    vllm_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = vllm_proxy.openai("e2e-plain", monkeypatch)
    resp = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi."},
        ],
        max_tokens=24,
        seed=7,
    )
    assert resp.object == "chat.completion"
    assert resp.model == "gpt-4o-mini"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert 1 <= resp.usage.completion_tokens <= 24

    rows = vllm_proxy.turns("e2e-plain", expect=1)
    assert len(rows) == 1
    row = rows[0]
    assert row["completion_ids"] and len(row["completion_ids"]) == len(row["completion_logprobs"])
    assert resp.usage.completion_tokens == len(row["completion_ids"])
    assert resp.usage.prompt_tokens == len(row["prompt_ids"])
    assert all(lp <= 0.0 for lp in row["completion_logprobs"])


def test_recorded_tokens_equal_what_vllm_returns(
    vllm_proxy: Proxy, vllm_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same prompt ids and seed straight to vLLM: the shard holds exactly vLLM's ids and logprobs."""
    import urllib.request

    client = vllm_proxy.openai("e2e-exact", monkeypatch)
    client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=16,
        seed=1234,
    )
    row = vllm_proxy.turns("e2e-exact", expect=1)[0]
    models = json.load(urllib.request.urlopen(f"{vllm_url}/v1/models"))
    body = {
        "model": models["data"][0]["id"],
        "prompt": row["prompt_ids"],
        "max_tokens": 16,
        "seed": 1234,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": True,
    }
    req = urllib.request.Request(
        f"{vllm_url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    direct = json.load(urllib.request.urlopen(req))["choices"][0]
    assert row["completion_ids"] == direct["token_ids"]
    # Shards store float32; vLLM's float64 rounded to float32 must match exactly.
    import numpy as np

    expected = np.asarray(direct["logprobs"]["token_logprobs"], dtype=np.float32)
    assert np.array_equal(np.asarray(row["completion_logprobs"], dtype=np.float32), expected)


def test_streaming_is_incremental_and_recorded(
    vllm_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = vllm_proxy.openai("e2e-stream", monkeypatch)
    start = time.monotonic()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage = None
    finish = None
    stream = client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=300,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        arrivals.append(time.monotonic() - start)
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 300
    assert len(arrivals) > 20
    # Real streaming: the first token reaches the client long before the last one.
    first_content = arrivals[1]
    assert first_content < 0.5 * arrivals[-1], arrivals[:5] + arrivals[-3:]

    row = vllm_proxy.turns("e2e-stream", expect=1)[0]
    assert row["stream"] is True
    assert len(row["completion_ids"]) == 300 == len(row["completion_logprobs"])
    assert "".join(pieces) == row["completion_text"]


def test_plain_program_with_only_env_vars(vllm_proxy: Proxy) -> None:
    """A separate program that knows nothing of the proxy: only HTTPS_PROXY and SSL_CERT_FILE."""
    program = (
        "import openai\n"
        "c = openai.OpenAI(api_key='sk-program-secret')\n"
        "r = c.chat.completions.create(model='gpt-4o', messages=[{'role':'user','content':'hi'}], max_tokens=8)\n"
        "print(r.choices[0].finish_reason, r.usage.completion_tokens)\n"
    )
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI")}
    env.update(vllm_proxy.env("e2e-program"))
    out = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    reason, n = out.stdout.split()
    assert reason in ("stop", "length") and 1 <= int(n) <= 8
    rows = vllm_proxy.turns("e2e-program", expect=1)
    assert len(rows) == 1 and len(rows[0]["completion_ids"]) == int(n)
    # The API key went nowhere: not in the proxy's log, not in any journal or shard.
    assert "sk-program-secret" not in vllm_proxy.log.read_text(errors="replace")
    for path in vllm_proxy.out.rglob("*"):
        if path.is_file():
            assert b"sk-program-secret" not in path.read_bytes()


def _raw_proxy_request(port: int, request: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            piece = sock.recv(4096)
            if not piece:
                return data
            data += piece
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        while len(body) < length:
            piece = sock.recv(4096)
            if not piece:
                break
            body += piece
    return head + b"\r\n\r\n" + body


def test_other_hosts_are_refused_never_tunnelled(vllm_proxy: Proxy) -> None:
    auth = b"Proxy-Authorization: Basic ZTJlLXJlZnVzZTp4\r\n"  # e2e-refuse:x
    answer = _raw_proxy_request(
        vllm_proxy.port,
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n" + auth + b"\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert b"not an intercepted API host" in answer
    answer = _raw_proxy_request(
        vllm_proxy.port,
        b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n" + auth + b"\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    # An intercepted host is answered by the proxy itself, not tunnelled.
    answer = _raw_proxy_request(
        vllm_proxy.port,
        b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n" + auth + b"\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
