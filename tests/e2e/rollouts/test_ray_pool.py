"""Many proxies on Ray (capture/client/ray_pool.py): a local Ray cluster, a pool of two proxy actors
(each a real mitmdump started by the launcher) in front of two scripted policy replicas; real
openai SDK calls through each session's base URL; rows read back as one dataset."""

from __future__ import annotations

import re
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from capture.client.ray_pool import ProxyPool, open_dataset
from tests.support.paths import QWEN3
from tests.support.proxies import processes_with
from tests.support.stub_vllm import StubPolicy

ray = pytest.importorskip("ray")

REPLIES = ["Answer from replica A.", "Answer from replica B."]


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[StubPolicy]]:
    stubs = []
    for reply in REPLIES:
        stub = StubPolicy(str(QWEN3))
        stub.default_reply = reply
        stub.start()
        stubs.append(stub)
    yield stubs
    for stub in stubs:
        stub.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(
    cluster: None, replicas: list[StubPolicy], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyPool]:
    tmp = tmp_path_factory.mktemp("ray-pool")
    (tmp / "store").mkdir()
    started = ProxyPool.start(
        [stub.url for stub in replicas],
        QWEN3,
        tmp / "root",
        num_proxies=2,
        num_cpus=0.5,  # of the cluster's 2: Ray Data's read tasks need one left over
        upload_to="rollouts",
        upload_filesystem=pafs.SubTreeFileSystem(str(tmp / "store"), pafs.LocalFileSystem()),
    )
    yield started
    started.shutdown(timeout=60)


def ids_by_replica(n_replicas: int, per_replica: int) -> list[list[str]]:
    found: list[list[str]] = [[] for _ in range(n_replicas)]
    k = 0
    while min(len(ids) for ids in found) < per_replica:
        sid = f"ray-pool-{k}"
        ids = found[zlib.crc32(sid.encode()) % n_replicas]
        if len(ids) < per_replica:
            ids.append(sid)
        k += 1
    return found


def chat(base_url: str, sid: str, calls: int, key: str) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    history: list[dict[str, str]] = []
    answers = []
    for i in range(calls):
        history.append({"role": "user", "content": f"step {i} of session {sid}"})
        answer = client.chat.completions.create(model="m", messages=history)  # type: ignore[arg-type]
        text = answer.choices[0].message.content or ""
        history.append({"role": "assistant", "content": text})
        answers.append(text)
    return answers


def sessions_seen(stub: StubPolicy) -> set[str]:
    prompts = [stub.tok.decode(body["prompt"]) for body in stub.requests]
    return {sid for text in prompts for sid in re.findall(r"ray-pool-\d+", text)}


def test_sessions_placed_on_both_actors_keep_replica_affinity_and_read_back_as_one_dataset(
    pool: ProxyPool, replicas: list[StubPolicy]
) -> None:
    infos = pool.stats()
    assert [i["name"] for i in infos] == ["proxy-0", "proxy-1"]
    assert len({i["pid"] for i in infos}) == 2 and all(i["alive"] for i in infos)
    assert pool.policy_urls == [stub.url for stub in replicas]
    # Two sessions hashing to each replica, opened one after another: least-loaded placement
    # alternates actors, so each actor holds one session of each replica.
    (a1, a2), (b1, b2) = ids_by_replica(2, 2)
    order = [a1, a2, b1, b2]
    sessions = [pool.open_session(metadata={"task_id": sid}, session_id=sid) for sid in order]
    assert [s.proxy for s in sessions] == [0, 1, 0, 1]
    assert [pool.proxy_of(sid) for sid in order] == [0, 1, 0, 1]
    assert [load["sessions"] for load in pool.loads()] == [2, 2]
    assert {s.base_urls["openai"].split("/sess/")[0] for s in sessions} == {
        i["api_url"] for i in infos
    }
    with ThreadPoolExecutor(4) as workers:
        answers = list(
            workers.map(lambda s: chat(s.base_urls["openai"], s.id, 2, s.api_key), sessions)
        )
    # Each session hit the replica its id's hash names, whichever actor held it.
    for sess, got in zip(sessions, answers, strict=True):
        replica = [stub.url for stub in replicas].index(pool.replica_for(sess.id))
        assert got == [REPLIES[replica]] * 2, (sess.id, sess.proxy, got)
    assert sessions_seen(replicas[0]) == {a1, a2}
    assert sessions_seen(replicas[1]) == {b1, b2}

    rewards = {sid: 0.25 * n for n, sid in enumerate(order)}
    for sess in sessions:
        table = sess.close(reward=rewards[sess.id])
        assert table.num_rows == 1
        assert table.column("reward").to_pylist() == [rewards[sess.id]]
        assert table.column("session_id").to_pylist() == [sess.id]
    assert [s["closed"] for s in pool.stats()] == [2, 2]
    assert [load["sessions"] for load in pool.loads()] == [0, 0]

    # Every proxy's shards as one dataset: uploaded (the SubTreeFileSystem) and local.
    where = {sid: f"proxy-{i}" for sid, i in zip(order, [0, 1, 0, 1], strict=True)}
    for dataset in (pool.dataset(), open_dataset(f"file://{pool.out_root}")):
        rows = dataset.to_table().to_pylist()
        assert {r["session_id"]: (r["proxy"], r["reward"]) for r in rows} == {
            sid: (where[sid], rewards[sid]) for sid in order
        }
        assert len(rows) == 4
    assert pool.dataset("turns").count_rows() == 8
    assert len(pool.shard_files("threads")) == 4  # one per session, two per proxy folder
    ray_rows = pool.ray_dataset().select_columns(["session_id", "reward"]).take_all()
    assert sorted((r["session_id"], r["reward"]) for r in ray_rows) == sorted(rewards.items())

    # A late reward goes to the proxy that held the session, and is uploaded too.
    pool.reward(a1, 2.0)
    assert pool.shard_files("rewards")


def test_a_new_session_goes_to_the_actor_with_fewer_calls_in_flight(
    pool: ProxyPool, replicas: list[StubPolicy]
) -> None:
    first = pool.open_session(session_id="ray-pool-busy")
    second = pool.open_session(session_id="ray-pool-idle")
    assert {first.proxy, second.proxy} == {0, 1}
    for stub in replicas:
        stub.first_delay_s = 3.0
    try:
        slow = threading.Thread(
            target=chat, args=(first.base_urls["openai"], first.id, 1, first.api_key)
        )
        slow.start()
        deadline = time.monotonic() + 10
        while pool.loads()[first.proxy]["in_flight"] == 0:
            assert time.monotonic() < deadline, "the call never showed as in flight"
            time.sleep(0.05)
        # Equal sessions (1 and 1): the one with no call in flight gets the next session.
        third = pool.open_session(session_id="ray-pool-third")
        assert third.proxy == second.proxy
        slow.join(30)
    finally:
        for stub in replicas:
            stub.first_delay_s = 0.0
    assert {s["id"]: s["proxy"] for s in pool.sessions()} == {
        first.id: first.proxy,
        second.id: second.proxy,
        third.id: second.proxy,
    }
    for sess in (first, second, third):
        sess.close(reward=1.0)
    assert pool.dataset().count_rows() == 5  # four sessions before, one here made a call


def test_shutdown_stops_every_mitmdump_and_keeps_the_uploaded_shards(pool: ProxyPool) -> None:
    pids = [i["mitmdump_pid"] for i in pool.stats()]
    pool.shutdown()
    deadline = time.monotonic() + 10
    while processes_with(str(pool.out_root).encode()):
        assert time.monotonic() < deadline, "a mitmdump of the pool is still running"
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert pool.dataset().count_rows() == 5


def test_proxies_per_node_places_them_on_every_node(
    cluster: None, replicas: list[StubPolicy], tmp_path: Path
) -> None:
    per_node = ProxyPool.start(
        [stub.url for stub in replicas], QWEN3, tmp_path, proxies_per_node=2, num_cpus=0.25
    )
    try:
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        infos = per_node.stats()
        assert len(infos) == 2 * len(nodes)
        assert {i["node_id"] for i in infos} == nodes
        sess = per_node.open_session(session_id="ray-pool-per-node")
        assert chat(sess.base_urls["openai"], sess.id, 1, sess.api_key) == [
            REPLIES[per_node.policy_urls.index(per_node.replica_for(sess.id))]
        ]
        assert sess.close(reward=0.5).column("reward").to_pylist() == [0.5]
    finally:
        per_node.shutdown(timeout=60)
    assert per_node.dataset().to_table().column("proxy").to_pylist() == [f"proxy-{sess.proxy}"]
