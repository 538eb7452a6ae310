"""Rollouts across a Ray cluster (``ProxyPool.rollout``, capture/client/pool_rollouts.py): a real
multi-node cluster on this machine (``ray.cluster_utils.Cluster``: a head and two more raylets,
one of them with no container engine), a pool with one proxy actor per node (each a real
mitmdump), agents that make a real HTTPS call through their node's proxy to a scripted policy,
the task's folder shipped from the driver through Ray's object store, and a verifier's reward.
A node removed while its agents run: ``node_lost``, or run again elsewhere with ``retries``,
within a bound, no row twice."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.client.ray_pool import ProxyPool
from capture.control.sessions import agent_seed, call_seed
from tests.support.paths import QWEN3
from tests.support.proxies import processes_with
from tests.support.stub_vllm import StubPolicy
from tests.support.task_images import task_folder

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

REPLY = "reply-from-the-pool-policy"
# An agent that makes one chat call (its prompt: the JSON body) through its node's proxy and
# keeps the answer; the verifier: 1 when the answer and the shipped seed file are both there.
CURL = {
    "command": [
        "sh", "-c",
        "curl -sS --fail-with-body https://api.openai.com/v1/chat/completions "
        '-H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" '
        '-d "$1" > reply.json',
        "agent",
    ]
}  # fmt: skip
VERIFIER = [
    "sh", "-c",
    f"grep -q {REPLY} reply.json && grep -q shipped-seed seed.txt && echo 1 || echo 0",
]  # fmt: skip
SMALL = {"memory_mb": 512, "disk_mb": 64}
# How long after a node's removal the group may take to answer: Ray's node-death detection
# (this cluster's health checks: 3 x 500 ms) plus the pool's poll, with room for a busy machine.
LOSS_BOUND_S = 45.0


def chat(marker: str) -> str:
    return json.dumps(
        {"model": "gpt-4o", "max_tokens": 8, "messages": [{"role": "user", "content": marker}]}
    )


@pytest.fixture(scope="module")
def policy() -> Iterator[StubPolicy]:
    stub = StubPolicy(str(QWEN3))
    stub.default_reply = REPLY
    stub.start()
    yield stub
    stub.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    system = {
        "health_check_period_ms": 500,
        "health_check_timeout_ms": 500,
        "health_check_failure_threshold": 3,
        "health_check_initial_delay_ms": 0,
    }
    made = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "_system_config": system},
    )
    worker = made.add_node(num_cpus=2)
    # A node whose container engine is not to be used (as a node without podman).
    plain = made.add_node(num_cpus=2, env_vars={"AGENTTAP_CONTAINER_ENGINE": "none"})
    # Cluster writes its address where a plain ray.init() looks first (/tmp/ray): any other
    # Ray user on this machine (another test's local cluster) would join this one. Forgotten.
    ray._common.utils.reset_ray_address()
    made.wait_for_nodes()
    ray.init(address=made.address, log_to_driver=False)
    try:
        yield {"cluster": made, "worker": worker, "plain": plain}
    finally:
        ray.shutdown()
        made.shutdown()


@pytest.fixture(scope="module")
def pool(
    cluster: dict[str, Any], policy: StubPolicy, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyPool]:
    root = tmp_path_factory.mktemp("ray-rollouts") / "root"
    started = ProxyPool.start(policy.url, QWEN3, root, proxies_per_node=1, num_cpus=0.25)
    try:
        yield started
    finally:
        started.shutdown(timeout=60)
        # A removed node's mitmdump outlives its raylet on this one machine (a lost machine
        # takes it along): end it here.
        for pid in processes_with(str(root).encode()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("seed") / "task"
    folder.mkdir()
    (folder / "seed.txt").write_text("shipped-seed\n")
    return folder


def node_of(pool: ProxyPool) -> dict[int, str]:
    return {int(i["index"]): str(i["node_id"]) for i in pool.infos}


def rows_by_session(pool: ProxyPool) -> dict[str, int]:
    pool.flush()
    counts: dict[str, int] = {}
    for sid in pool.dataset().to_table(columns=["session_id"]).column("session_id").to_pylist():
        counts[sid] = counts.get(sid, 0) + 1
    return counts


def test_a_group_of_8_is_spread_over_the_nodes_scored_and_read_as_one_dataset(
    pool: ProxyPool, seed: Path, policy: StubPolicy
) -> None:
    nodes = node_of(pool)
    assert len(set(nodes.values())) == 3
    answer = pool.rollout(
        CURL, chat("spread-group"), n=8, workdir=seed, verifier=VERIFIER, limits=SMALL,
        id="spread", seed=5,
    )  # fmt: skip
    runs = answer["rollouts"]
    assert [r["index"] for r in runs] == list(range(8))
    assert [r["session_id"] for r in runs] == [f"spread-{i}" for i in range(8)]
    assert all(r["status"] == "ok" and r["reward"] == 1.0 for r in runs), [
        (r["error"], r["agent_output"][-300:], r["verifier_output"]) for r in runs
    ]
    # Each rollout names the node and actor that ran it, and the group used every node.
    for run in runs:
        assert run["node"] == nodes[run["proxy"]]
        assert run["rows"], run
    assert set(answer["nodes"]) == set(nodes.values())
    assert sum(answer["nodes"].values()) == 8
    # Seeded as one group on one proxy would be: agent i's calls carry agent_seed(5, i)'s seeds,
    # whichever actor ran it (each share is numbered from its first_index).
    bodies = [b for b in policy.requests if "spread-group" in policy.tok.decode(b["prompt"])]
    assert len(bodies) == 8
    prompt = bodies[0]["prompt"]
    assert all(b["prompt"] == prompt for b in bodies)
    assert sorted(b["seed"] for b in bodies) == sorted(
        call_seed(agent_seed(5, i), prompt) for i in range(8)
    )
    # One dataset: each agent's rows once, from the proxy folder of the actor that ran it.
    table = pool.dataset().to_table(columns=["session_id", "proxy", "reward"]).to_pylist()
    got = {r["session_id"]: r for r in table if r["session_id"].startswith("spread-")}
    assert len([r for r in table if r["session_id"].startswith("spread-")]) == 8
    for run in runs:
        assert got[run["session_id"]]["proxy"] == f"proxy-{run['proxy']}"
        assert got[run["session_id"]]["reward"] == 1.0
    # The group's files (agent logs, kept work folders) come back to the driver.
    folders = pool.rollout_files("spread", pool.out_root.parent / "files")
    assert len(folders) == len(answer["nodes"])
    kept = sorted(p.parent.name for f in folders for p in f.glob("*/agent.log"))
    assert len(kept) == 8, folders


def test_an_image_rollout_never_goes_to_a_node_without_an_engine(
    pool: ProxyPool, cluster: dict[str, Any]
) -> None:
    harbor = task_folder("harbor-fix-script")
    plain = next(i for i, node in node_of(pool).items()
                 if node == cluster["plain"].node_id)  # fmt: skip
    caps = {c.index: c for c in pool.capacities()}
    assert caps[plain].engine == "" and all(c.engine for i, c in caps.items() if i != plain)
    solve = ["bash", "-c", (harbor / "solution" / "solve.sh").read_text()]
    # The task's own solution as the agent (it calls no model: scored all the same).
    answer = pool.rollout(
        {"command": solve}, "solve", n=4, task=harbor, id="in-images",
        verifier={"on_error": "score"},
    )  # fmt: skip
    runs = answer["rollouts"]
    # Graded by the task's tests in its image (status "error": the agent made no model call).
    assert [r["reward"] for r in runs] == [1.0] * 4, [
        (r["error"], r["verifier_output"]) for r in runs
    ]
    # The control: the same node ran plain rollouts (the group of 8 used every node; here
    # the plain node's actor reports the most memory free, so only its engine kept it off).
    assert plain not in {r["proxy"] for r in runs}
    assert caps[plain].memory_mb >= max(c.memory_mb for c in caps.values())


def test_a_node_lost_mid_rollout_ends_node_lost_or_runs_again(
    pool: ProxyPool, cluster: dict[str, Any], policy: StubPolicy, seed: Path
) -> None:
    made: Cluster = cluster["cluster"]
    worker = cluster["worker"]
    doomed = next(i for i, node in node_of(pool).items() if node == worker.node_id)
    policy.set_paused(True)  # every agent's call waits at the policy
    try:
        lost = pool.rollout(
            CURL, chat("lost-group"), n=3, workdir=seed, verifier=VERIFIER, limits=SMALL,
            id="lost", wait=False,
        )  # fmt: skip
        again = pool.rollout(
            CURL, chat("retried-group"), n=3, workdir=seed, verifier=VERIFIER, limits=SMALL,
            id="again", wait=False, retries=1,
        )  # fmt: skip
        assert lost["status"] == again["status"] == "running"
        deadline = time.monotonic() + 60
        markers = ("lost-group", "retried-group")
        while len([b for b in policy.requests
                   if any(m in policy.tok.decode(b["prompt"]) for m in markers)]) < 6:  # fmt: skip
            assert time.monotonic() < deadline, "the agents' calls never reached the policy"
            time.sleep(0.2)
        where = {s["id"]: s["proxy"] for s in pool.sessions()}
        on_doomed = sorted(sid for sid, proxy in where.items() if proxy == doomed)
        assert any(s.startswith("lost-") for s in on_doomed), where
        assert any(s.startswith("again-") for s in on_doomed), where
        removed_at = time.monotonic()
        made.remove_node(worker, allow_graceful=False)
    finally:
        policy.set_paused(False)
    answers = {}
    for rid in ("lost", "again"):
        while (answer := pool.get_rollout(rid))["status"] != "done":
            assert time.monotonic() - removed_at < LOSS_BOUND_S + 60, answer
            time.sleep(0.2)
        answers[rid] = answer
    took = time.monotonic() - removed_at
    print(f"node removed -> both groups answered in {took:.1f} s")
    assert took < LOSS_BOUND_S
    # Without retries: the doomed node's rollouts end node_lost, no reward; the rest are scored.
    for run in answers["lost"]["rollouts"]:
        if run["session_id"] in on_doomed:
            assert run["finish_reason"] == "node_lost" and run["reward"] is None, run
            assert run["node"] == worker.node_id
        else:
            assert run["status"] == "ok" and run["reward"] == 1.0, run
    # With retries=1: they ran again on another node under new session ids, and were scored.
    runs = answers["again"]["rollouts"]
    retried = [r for r in runs if r["session_id"].startswith("again-retry1-")]
    assert len(retried) == len([s for s in on_doomed if s.startswith("again-")])
    for run in answers["again"]["rollouts"]:
        assert run["status"] == "ok" and run["reward"] == 1.0, run
        assert run["node"] != worker.node_id
    assert {e["node"] for e in answers["again"]["lost"]} == {worker.node_id}
    # No row twice: the lost attempts' sessions are never read back, whatever reached storage.
    lost_ids = set(pool.lost_sessions())
    assert set(on_doomed) <= lost_ids
    counts = rows_by_session(pool)
    assert not lost_ids & set(counts)
    for answer in answers.values():
        for run in answer["rollouts"]:
            if run["finish_reason"] != "node_lost":
                assert counts.get(run["session_id"]) == 1, (run["session_id"], counts)
    # The pool goes on with the nodes left: a new group never goes to the lost node.
    after = pool.rollout(CURL, chat("after-loss"), n=2, workdir=seed, verifier=VERIFIER,
                         limits=SMALL, id="after")  # fmt: skip
    assert {r["reward"] for r in after["rollouts"]} == {1.0}
    assert doomed not in {r["proxy"] for r in after["rollouts"]}
