"""What the rollout sandbox costs: a rollout's wall time and a model call's latency from inside
it, unsandboxed (the baseline) and in bwrap, measured in one run.

    .venv/bin/python bench/sandbox.py [--rollouts 20] [--calls 5]

A real mitmdump started by the launcher (capture/client/launcher.py) with the scripted stub
policy. Each rollout (n=1, one after another, the order of the paths interleaved) runs a small
Python agent that makes --calls chat calls through the session's HTTPS_PROXY (raw http.client:
no SDK import to swamp the numbers) and reports each call's latency as it saw it. Prints, per
path: the rollout's wall time (request to answer, p50 / p95), the agent's calls (p50 / p95),
and each as a ratio of the unsandboxed path's. In bwrap a call crosses the forwarder inside
the sandbox and the unix-socket relay outside it (capture/isolation/netbridge.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import rank_pct  # noqa: E402
from capture.client.launcher import AgentTap  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402
from tests.support.stub_vllm import StubPolicy  # noqa: E402

AGENT = r"""
import base64, http.client, json, os, ssl, sys, time, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
context = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
conn = http.client.HTTPSConnection(proxy.hostname, proxy.port, context=context, timeout=60)
conn.set_tunnel("api.openai.com", 443, headers={"Proxy-Authorization": f"Basic {auth}"})
times, messages = [], []
for i in range(int(sys.argv[-1])):
    messages.append({"role": "user", "content": f"step {i}"})
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 8})
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
                 "Authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "x")})
    answer = json.loads(conn.getresponse().read())
    times.append(time.perf_counter() - start)
    messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
open("times.json", "w").write(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    stub = StubPolicy(str(QWEN3))
    stub.default_reply = "A short answer."
    stub.start()
    tmp = Path(tempfile.mkdtemp(prefix="agenttap-bench-sandbox-"))
    tap = AgentTap.start(stub.url, QWEN3, tmp / "out", confdir=tmp / "conf")
    paths = ("none", "bwrap")
    walls: dict[str, list[float]] = {p: [] for p in paths}
    calls: dict[str, list[float]] = {p: [] for p in paths}
    try:
        for i in range(args.rollouts + 1):
            for path in paths if i % 2 else reversed(paths):
                body = {
                    "agent": {"command": [sys.executable, "-I", "-c", AGENT]},
                    "prompt": str(args.calls),
                    "sandbox": path,
                }
                start = time.perf_counter()
                result = tap.client.request("POST", "/rollouts", body, timeout=None)[0]
                wall = time.perf_counter() - start
                (run,) = result["rollouts"]
                if run["status"] != "ok":
                    raise SystemExit(
                        f"a {path} rollout failed: {run['error']}: {run['agent_output']}"
                    )
                if i == 0:
                    continue  # warm-up: the first of each starts the bridge, fills caches
                walls[path].append(wall)
                calls[path].extend(json.loads((Path(run["workdir"]) / "times.json").read_text()))
    finally:
        tap.close()
        stub.stop()
    base_wall = statistics.median(walls["none"])
    base_call = statistics.median(calls["none"])
    print(f"\n{args.rollouts} rollouts per path, {args.calls} calls each (stub policy)\n")
    print("| path | rollout wall p50 ms | p95 ms | x none | call p50 ms | p95 ms | x none |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        wall, call = walls[path], calls[path]
        print(
            f"| {path} | {statistics.median(wall) * 1e3:.1f} | {rank_pct(wall, 0.95) * 1e3:.1f} | "
            f"{statistics.median(wall) / base_wall:.2f}x | {statistics.median(call) * 1e3:.2f} | "
            f"{rank_pct(call, 0.95) * 1e3:.2f} | {statistics.median(call) / base_call:.2f}x |"
        )


if __name__ == "__main__":
    main()
