"""Latency the proxy adds to a chat call: the openai and anthropic SDKs through mitmdump + the
addon, against the same prompt token ids sent straight to vLLM's /v1/completions.

    .venv/bin/python bench/latency.py [--calls 50] [--max-tokens 1] [--warmup 5]

Starts its own vLLM (the tiny embedded Qwen3 policy, prefix caching off so that neither path
profits from the other's cache) and its own mitmdump. Calls are interleaved, alternating which
path goes first, after a warm-up; each call i uses prompt i on every path, and the script checks
that the proxy sent vLLM exactly the prompt ids of the baseline. (Anthropic's default is no
thinking, so its baseline prompt is the template's with thinking off.)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import pct  # noqa: E402
from policy_server import launcher as policy_server  # noqa: E402
from rewriter.canonical import Message  # noqa: E402
from rewriter.template import ChatTemplate  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402
from tests.support.proxies import read_turns, start_proxy  # noqa: E402

SESSION = "bench-latency"


def messages_for(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": f"Question {i}: what is {i} plus {i * 3}?"},
    ]


class DirectClient:
    """vLLM's token-id completions API over one kept-alive connection, as the gateway calls it."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=120)
        self.model = model
        self.max_tokens = max_tokens

    def complete(self, prompt_ids: list[int]) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": self.max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": True,
            "stream": False,
        }
        self.conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = self.conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            raise RuntimeError(f"vLLM answered {resp.status}: {data}")
        return data


def run(calls: int, warmup: int, max_tokens: int, work: Path) -> int:
    model_dir = policy_server.ensure_tiny_model(tokenizer=QWEN3)
    port = policy_server.free_port()
    vllm_url = f"http://127.0.0.1:{port}"
    vllm_log = work / "vllm.log"
    print(f"starting vLLM at {vllm_url} (about a minute on a CPU) ...", flush=True)
    vllm = policy_server.start_vllm(
        model_dir,
        port,
        log_path=vllm_log,
        max_model_len=4096,
        extra_args=["--no-enable-prefix-caching"],
    )
    proxy = None
    try:
        policy_server.wait_ready(vllm_url, vllm, timeout_s=600)
        (work / "conf").mkdir()
        proxy = start_proxy(vllm_url, work / "out", work / "conf")
        print(f"mitmdump with the addon on 127.0.0.1:{proxy.port}", flush=True)

        import openai

        os.environ.pop("OPENAI_BASE_URL", None)
        os.environ.update(proxy.env(SESSION))
        client = openai.OpenAI(api_key="sk-bench", max_retries=0, timeout=120)
        import anthropic

        os.environ.pop("ANTHROPIC_BASE_URL", None)
        claude = anthropic.Anthropic(api_key="sk-ant-bench", max_retries=0, timeout=120)
        with urllib.request.urlopen(f"{vllm_url}/v1/models", timeout=30) as resp:
            served = json.load(resp)["data"][0]["id"]
        direct = DirectClient(vllm_url, served, max_tokens)
        template = ChatTemplate(QWEN3)

        def prompt_ids(i: int, thinking: bool | None = None) -> list[int]:
            msgs = [Message(role=m["role"], content=m["content"]) for m in messages_for(i)]  # type: ignore[arg-type]
            return template.render(msgs, enable_thinking=thinking)

        def via_proxy(i: int) -> Any:
            return client.chat.completions.create(
                model="gpt-4o-mini", messages=messages_for(i), max_tokens=max_tokens
            )

        def via_anthropic(i: int) -> Any:
            system, user = messages_for(i)
            return claude.messages.create(
                model="claude-haiku-5-5",
                system=system["content"],
                messages=[user],  # type: ignore[list-item]
                max_tokens=max_tokens,
            )

        def timed(fn: Any, *args: Any) -> tuple[float, Any]:
            start = time.perf_counter()
            out = fn(*args)
            return (time.perf_counter() - start) * 1000.0, out

        for i in range(warmup):
            via_proxy(-1 - i)
            via_anthropic(-1 - i)
            direct.complete(prompt_ids(-1 - i))

        base_ms: list[float] = []
        proxy_ms: list[float] = []
        anth_ms: list[float] = []
        ids_by_call: dict[int, list[int]] = {}
        anth_ids_by_call: dict[int, list[int]] = {}
        paths = ("direct", "openai", "anthropic")
        for i in range(calls):
            ids = prompt_ids(i)  # rendering is part of the proxy's work, not the baseline's
            ids_by_call[i] = ids
            anth_ids_by_call[i] = prompt_ids(i, thinking=False)
            order = paths[i % 3 :] + paths[: i % 3]
            for path in order:
                if path == "direct":
                    ms, data = timed(direct.complete, ids)
                    assert len(data["choices"][0]["token_ids"]) >= 1
                    base_ms.append(ms)
                elif path == "openai":
                    ms, resp = timed(via_proxy, i)
                    assert resp.usage.prompt_tokens == len(ids)
                    proxy_ms.append(ms)
                else:
                    ms, msg = timed(via_anthropic, i)
                    assert msg.usage.input_tokens == len(anth_ids_by_call[i])
                    anth_ms.append(ms)

        # Same prompts: the proxy recorded exactly the baseline's prompt ids, call by call.
        rows: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(rows) < 2 * (warmup + calls):
            time.sleep(0.5)
            rows = read_turns(proxy.out, SESSION)
        rows.sort(key=lambda r: r["started_at"])

        def recorded(protocol: str) -> list[list[int]]:
            return [r["prompt_ids"] for r in rows if r["protocol"] == protocol][warmup:]

        same = recorded("openai.chat") == [ids_by_call[i] for i in range(calls)]
        same_anth = recorded("anthropic.messages") == [anth_ids_by_call[i] for i in range(calls)]

        diffs = [p - b for p, b in zip(proxy_ms, base_ms, strict=True)]
        anth_diffs = [p - b for p, b in zip(anth_ms, base_ms, strict=True)]
        med_b, med_p = statistics.median(base_ms), statistics.median(proxy_ms)
        med_a = statistics.median(anth_ms)
        print()
        print(
            f"{calls} non-streamed calls each, max_tokens={max_tokens}, "
            f"prompt {len(ids_by_call[0])} tokens, after {warmup} warm-up calls each, interleaved"
        )
        print(f"{'path':<44} {'median ms':>10} {'p90 ms':>10} {'min ms':>10}")
        print(
            f"{'(a) direct vLLM /v1/completions (token ids)':<44} {med_b:>10.1f} "
            f"{pct(base_ms, 0.9):>10.1f} {min(base_ms):>10.1f}"
        )
        print(
            f"{'(b) openai SDK -> mitmdump+addon -> vLLM':<44} {med_p:>10.1f} "
            f"{pct(proxy_ms, 0.9):>10.1f} {min(proxy_ms):>10.1f}"
        )
        print(
            f"{'(c) anthropic SDK -> mitmdump+addon -> vLLM':<44} {med_a:>10.1f} "
            f"{pct(anth_ms, 0.9):>10.1f} {min(anth_ms):>10.1f}"
        )
        print(
            f"added latency (b): median of paired (b - a) {statistics.median(diffs):.1f} ms, "
            f"median(b) - median(a) {med_p - med_b:.1f} ms, p90 of (b - a) "
            f"{pct(diffs, 0.9):.1f} ms; ratio median(b)/median(a) {med_p / med_b:.2f}x"
        )
        print(
            f"added latency (c): median of paired (c - a) {statistics.median(anth_diffs):.1f} ms, "
            f"p90 of (c - a) {pct(anth_diffs, 0.9):.1f} ms; "
            f"ratio median(c)/median(a) {med_a / med_b:.2f}x"
        )
        print(
            f"prompt ids recorded by the proxy equal the baseline's: openai {same}, "
            f"anthropic {same_anth} ({len(rows)} turns)"
        )
        return 0 if same and same_anth else 1
    except BaseException:
        for log in (vllm_log, work / "out-mitmdump.log"):
            if log.exists():
                print(f"--- {log.name} (tail) ---\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        if proxy is not None:
            proxy.stop()
        policy_server.stop(vllm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="measured calls per path")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured calls per path first")
    parser.add_argument("--max-tokens", type=int, default=1, help="completion tokens per call")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agenttap-bench-") as tmp:
        return run(args.calls, args.warmup, args.max_tokens, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
