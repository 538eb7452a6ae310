"""Rollouts across a Ray cluster (``ProxyPool.rollout``, issue 50): rollouts per minute with one
and two nodes' actors, and the time from a node's loss to the group's answer.

    .venv/bin/python bench/ray_rollouts.py [--group 8] [--rounds 3] [--calls 2]

A real multi-node Ray cluster on this host (``ray.cluster_utils.Cluster``): the head alone, then
the head and one more raylet; one proxy actor per node (``proxies_per_node=1``, each a real
mitmdump), a scripted stub policy in its own process. The task is fixed: each agent (bwrap
sandbox) makes --calls chat calls through its node's proxy with curl, the verifier checks the
answer file, the seed workdir is shipped from the driver. Per size, --rounds groups of --group
agents; the table gives rollouts per minute (median round) and the ratio to one node. Both
nodes share this host's cores, so the ratio says what the pool adds here, not what two machines
give. Then the loss: a group whose agents wait at the (paused) policy, a node removed, the time
until the group answers (its rollouts there ``node_lost``), with this cluster's health checks
(500 ms x 3) and with Ray's defaults.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import serve_stub  # noqa: E402
from capture.client.ray_pool import ProxyPool  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402

REPLY = "bench-reply"
FAST_CHECKS = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 0,
}


def agent(calls: int) -> dict[str, list[str]]:
    one = (
        "curl -sS --fail-with-body https://api.openai.com/v1/chat/completions "
        '-H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" '
        '-d "$1" >> reply.json'
    )
    return {"command": ["sh", "-c", "; ".join([one] * calls), "agent"]}


VERIFIER = ["sh", "-c", f"grep -q {REPLY} reply.json && echo 1 || echo 0"]
LIMITS = {"memory_mb": 512, "disk_mb": 64}


def chat(marker: str) -> str:
    body = {"model": "gpt-4o", "max_tokens": 8, "messages": [{"role": "user", "content": marker}]}
    return json.dumps(body)


def cluster(nodes: int, system: dict[str, Any] | None) -> Any:
    import ray
    from ray.cluster_utils import Cluster

    made = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 2, "include_dashboard": False, "_system_config": system or {},
        },
    )  # fmt: skip
    extra = [made.add_node(num_cpus=2) for _ in range(nodes - 1)]
    # Cluster writes its address where a plain ray.init() looks first (/tmp/ray): any other
    # Ray user on this machine (another test's local cluster) would join this one. Forgotten.
    ray._common.utils.reset_ray_address()
    made.wait_for_nodes()
    ray.init(address=made.address, log_to_driver=False, logging_level="error")
    return made, extra


def throughput(nodes: int, url: str, seed: Path, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    made, _ = cluster(nodes, None)
    root = Path(tempfile.mkdtemp(prefix=f"agenttap-bench-ray-rollouts-{nodes}-"))
    pool = ProxyPool.start(url, QWEN3, root, proxies_per_node=1, num_cpus=0.25)
    walls: list[float] = []
    spread: dict[str, int] = {}
    try:
        # One group first, not timed: each node's first sandbox and unpack.
        pool.rollout(agent(args.calls), chat("warm"), n=2, workdir=seed, limits=LIMITS)
        for k in range(args.rounds):
            started = time.monotonic()
            answer = pool.rollout(
                agent(args.calls), chat(f"round-{k}"), n=args.group, workdir=seed,
                verifier=VERIFIER, limits=LIMITS,
            )  # fmt: skip
            walls.append(time.monotonic() - started)
            rewards = [r["reward"] for r in answer["rollouts"]]
            if rewards != [1.0] * args.group:
                raise SystemExit(f"a rollout was not scored 1: {answer['rollouts']}")
            spread = answer["nodes"]
            print(f"{nodes} node(s), round {k + 1}: {walls[-1]:.1f} s", flush=True)
    finally:
        pool.shutdown(timeout=60)
        ray.shutdown()
        made.shutdown()
    wall = statistics.median(walls)
    return {"nodes": nodes, "wall": wall, "per_min": args.group * 60 / wall, "spread": spread}


def loss(url: str, seed: Path, system: dict[str, Any] | None, label: str) -> float:
    """Seconds from a node's removal to the answer of a group running on it."""
    import ray

    made, (worker,) = cluster(2, system)
    root = Path(tempfile.mkdtemp(prefix="agenttap-bench-ray-loss-"))
    pool = ProxyPool.start(url, QWEN3, root, proxies_per_node=1, num_cpus=0.25)
    try:
        _post(url + "/pause")
        try:
            pool.rollout(agent(1), chat("loss"), n=4, workdir=seed, limits=LIMITS,
                         id="loss", wait=False)  # fmt: skip
            deadline = time.monotonic() + 60
            while len(pool.sessions()) < 4 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)  # the agents' calls at the policy
            removed = time.monotonic()
            made.remove_node(worker, allow_graceful=False)
        finally:
            _post(url + "/resume")
        while pool.get_rollout("loss")["status"] != "done":
            time.sleep(0.05)
        took = time.monotonic() - removed
        lost = [
            r for r in pool.get_rollout("loss")["rollouts"] if r["finish_reason"] == "node_lost"
        ]
        print(f"loss ({label}): {len(lost)} rollout(s) node_lost, answered {took:.1f} s after")
        return took
    finally:
        pool.shutdown(timeout=60)
        ray.shutdown()
        made.shutdown()
        os.system(f"pkill -9 -f {root} >/dev/null 2>&1")  # the removed node's mitmdump


def _post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=30).read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--group", type=int, default=8, help="agents per group")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2, help="chat calls per agent")
    parser.add_argument("--no-loss", action="store_true", help="skip the node-loss timing")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=serve_stub, args=(QWEN3, REPLY), kwargs={"conn": child, "dev_mode": True},
        daemon=True,
    )  # fmt: skip
    proc.start()
    url = parent.recv()
    seed = Path(tempfile.mkdtemp(prefix="agenttap-bench-seed-")) / "task"
    seed.mkdir()
    (seed / "README.md").write_text("Ask once, keep the answer.\n")
    try:
        results = [throughput(n, url, seed, args) for n in (1, 2)]
        losses = {}
        if not args.no_loss:
            losses["health checks 500 ms x 3"] = loss(url, seed, FAST_CHECKS, "fast checks")
            losses["Ray's defaults"] = loss(url, seed, None, "Ray's defaults")
    finally:
        parent.close()
        proc.join(10)
    cores = os.cpu_count() or 1
    print(
        f"\ngroups of {args.group} agents ({args.calls} curl chat calls each, bwrap, verifier), "
        f"median of {args.rounds} round(s); one proxy actor per node; this host has {cores} "
        "core(s), shared by every node"
    )
    print(
        f"{'nodes':>5} {'wall s':>7} {'rollouts/min':>13} {'vs 1 node':>10} {'agents per node':>16}"
    )
    base = results[0]["per_min"]
    for r in results:
        spread = "/".join(str(v) for v in r["spread"].values())
        print(
            f"{r['nodes']:>5} {r['wall']:>7.1f} {r['per_min']:>13.1f} "
            f"{r['per_min'] / base:>9.2f}x {spread:>16}"
        )
    for label, took in losses.items():
        print(f"node lost -> group answered: {took:.1f} s ({label})")


if __name__ == "__main__":
    main()
