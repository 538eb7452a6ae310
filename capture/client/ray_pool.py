"""Many agenttap proxies on Ray: a pool of proxy actors over a host's cores and over hosts.

    import ray
    from capture.client.ray_pool import ProxyPool

    ray.init()                                         # the trainer's own cluster
    pool = ProxyPool.start(["http://gpu0:8000", "http://gpu1:8000"], "/models/qwen3",
                           "/shared/rollouts", num_proxies=8)
    sess = pool.open_session(metadata={"task_id": "t1"})   # on the least-loaded proxy
    OpenAI(base_url=sess.base_urls["openai"], api_key=sess.api_key)  # or sess.env (proxy mode)
    table = sess.close(reward=1.0)                     # its thread rows, as with AgentTap
    rows = pool.dataset().to_table()                   # every proxy's shards, one dataset
    pool.shutdown()

One mitmdump is one Python process and so one core. ``ProxyActor`` is a Ray actor that starts
one instance through ``capture.client.launcher.AgentTap`` on its node and drives it through
the control API; ``ProxyPool`` (the driver side) starts N of them (``SPREAD`` over the nodes, or
``proxies_per_node`` on every node), places each new session on the least-loaded actor (fewest
live sessions, then fewest calls in flight) and remembers which actor holds it.

Replica affinity across the pool: a session lives on one actor (the pool remembers which) and
that actor's gateway keeps it on one policy replica (``capture/policy/pools.py``). Every actor is
given the same ordered replica list (and the same ``agenttap_model_map``, if any), so whichever
actor holds a session, an idle proxy sends its first call to the same replica,
``crc32(session id) % len(replicas)`` (``ProxyPool.replica_for``); a gateway that places by
replica load too uses the hash to break ties, so under load the choice is that actor's.

Shards: actor ``n`` writes to ``OUT_ROOT/proxy-<n>/`` (``turns/``, ``threads/``, ...).
``OUT_ROOT`` is a local path: on one host, or a shared filesystem (NFS, ...) mounted at the same
path on every node, the pool reads it back as it is. The proxies write only local files; for an
object store (or any ``pyarrow.fs`` filesystem) give ``upload_to`` (a URI such as
``s3://bucket/rollouts`` or ``file:///data/rollouts``, or a path inside ``upload_filesystem``):
each actor copies its new shard files there after every close, flush and at shutdown (to a
hidden temporary name, then moved into place, so readers never see a partial file), and
``dataset()`` / ``ray_dataset()`` read from there. A node-local ``OUT_ROOT`` on several hosts
without ``upload_to``: the driver reads only the shards on its own disk.

Reaching the proxies: by default each instance listens on its node's loopback, so agents must
run on the node of the actor holding their session (``PoolSession.proxy``, ``ProxyPool.infos``);
``host="node"`` listens on the node's IP address instead (base URLs then name it; anyone who
reaches it can use the policy). A session's ``env`` (proxy mode) names that proxy's CA files,
kept in a temporary folder of its node.

Here: the driver side (``ProxyPool``, ``PoolSession``, placement). The actor is
``capture/client/proxy_actor.py``; the shard files, their upload and the dataset are
``capture/client/pool_shards.py``.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from capture.client.launcher import is_peft, trainer_probe
from capture.client.pool_groups import PoolGroups
from capture.client.pool_rollouts import GroupRun
from capture.client.pool_shards import (
    PROXY_COLUMN,
    load_lost,
    open_dataset,
    resolve_filesystem,
    shard_files,
)
from capture.client.proxy_actor import ProxyActor as ProxyActor  # importable from here too
from capture.client.proxy_actor import proxy_actor_class

if TYPE_CHECKING:
    import ray.data


def replica_for(session_id: str, replicas: list[str]) -> str:
    """The policy replica an idle proxy sends a session's calls to, whichever proxy holds it:
    ``capture.policy.pools.PolicyPools.client_for``'s hash (crc32 of the id, modulo the
    replicas)."""
    return replicas[zlib.crc32(session_id.encode()) % len(replicas)]


def actor_name(pool: str, index: int) -> str:
    """The Ray name of a named pool's actor ``index``."""
    return f"agenttap-{pool}-{index}"


def least_loaded(loads: list[dict[str, int]], placed: list[int]) -> int:
    """The index of the proxy a new session goes to: fewest sessions (the larger of what it
    reports live and what the pool placed there and has not closed), then fewest calls in
    flight, then the lowest index."""

    def score(i: int) -> tuple[int, int, int]:
        return (max(loads[i].get("sessions", 0), placed[i]), loads[i].get("in_flight", 0), i)

    return min(range(len(loads)), key=score)


@dataclass
class PoolSession:
    """A session on one of the pool's proxies; ``env`` / ``base_urls`` as ``Session``'s."""

    pool: ProxyPool
    id: str
    proxy: int
    env: dict[str, str]
    base_urls: dict[str, str]
    api_key: str = ""
    closed: bool = field(default=False)

    def close(self, reward: float | dict[str, float] | None = None) -> pa.Table:
        table = self.pool.close_session(self.id, reward)
        self.closed = True
        return table

    def reward(self, reward: float | dict[str, float]) -> None:
        self.pool.reward(self.id, reward)


class ProxyPool(PoolGroups):
    """N proxy actors; sessions placed on the least-loaded one; their shards as one dataset."""

    def __init__(
        self,
        actors: list[Any],
        infos: list[dict[str, Any]],
        policy_urls: list[str],
        out_root: Path,
        read_fs: pafs.FileSystem,
        read_base: str,
        load_refresh_s: float,
    ) -> None:
        self.actors = actors
        self.infos = infos
        self.policy_urls = policy_urls
        self.out_root = out_root
        self.read_fs = read_fs
        self.read_base = read_base
        self.load_refresh_s = load_refresh_s
        self._lock = threading.Lock()
        self._placed = [0] * len(actors)  # sessions the pool placed and has not closed
        self._where: dict[str, int] = {}  # session id -> actor index
        self._closed_on: dict[str, int] = {}  # closed sessions (late rewards) -> actor index
        self._loads: list[dict[str, int]] = [{} for _ in actors]
        self._loads_at = float("-inf")
        self._stopped = False
        self._groups: dict[str, GroupRun] = {}
        self._group_of: dict[str, tuple[str, int]] = {}  # rollout session id -> (group, actor)
        self._dead: set[int] = set()  # actors found dead (their node lost): never placed on
        self._lost: list[dict[str, Any]] = load_lost(read_fs, read_base)
        self._attached = False  # reached by name: its actors are the starting process's to end

    @classmethod
    def start(
        cls,
        policy_urls: str | list[str],
        tokenizer: str | os.PathLike[str],
        out_root: str | os.PathLike[str],
        num_proxies: int = 2,
        *,
        proxies_per_node: int | None = None,
        num_cpus: float = 1.0,
        max_concurrency: int = 64,
        host: str = "127.0.0.1",
        confdir: str | os.PathLike[str] | None = None,
        options: dict[str, str] | None = None,
        upload_to: str | None = None,
        upload_filesystem: pafs.FileSystem | None = None,
        load_refresh_s: float = 0.0,
        start_timeout: float = 120.0,
        name: str | None = None,
    ) -> ProxyPool:
        """Start the actors (Ray must be initialised) and wait until every instance answers.

        ``policy_urls``: the policy replicas, in one order for every actor (affinity);
        ``num_proxies`` actors spread over the nodes (``SPREAD``), or ``proxies_per_node`` on
        every alive node; ``num_cpus``: Ray CPUs each actor holds (its mitmdump uses about one
        core when busy); ``host``: where each instance listens (``"node"``: the node's IP
        address, for agents on other hosts; no authentication on the proxy port: see
        docs/SECURITY.md); ``out_root``: local or shared path, ``OUT_ROOT/proxy-<n>/`` per actor;
        ``upload_to`` (+ ``upload_filesystem``): copy shards there too (module docstring);
        ``load_refresh_s``: how long a poll of the actors' loads is reused for placing;
        ``name``: the actors are named Ray actors (``agenttap-NAME-<n>``), so that other
        processes of the job (verl's agent loop workers) reach the pool (``attach``)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        urls = [policy_urls] if isinstance(policy_urls, str) else list(policy_urls)
        urls = [u for part in urls for u in part.split(",") if u.strip()]
        if not urls:
            raise ValueError("ProxyPool needs at least one policy URL")
        root = Path(out_root).resolve()
        root.mkdir(parents=True, exist_ok=True)
        actor_cls = proxy_actor_class(num_cpus, max_concurrency)
        if proxies_per_node is not None:
            nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
            strategies: list[Any] = [
                NodeAffinitySchedulingStrategy(node, soft=False)
                for node in nodes
                for _ in range(proxies_per_node)
            ]
        else:
            strategies = ["SPREAD"] * num_proxies
        kwargs = {
            "host": host,
            "confdir": str(confdir) if confdir else None,
            "options": options,
            "upload_to": upload_to,
            "upload_filesystem": upload_filesystem,
            "start_timeout": start_timeout,
        }
        named = (lambda i: {"name": actor_name(name, i)}) if name else (lambda i: {})
        actors = [
            actor_cls.options(scheduling_strategy=strategy, **named(i)).remote(
                i, urls, str(Path(tokenizer).resolve()), str(root), **kwargs
            )
            for i, strategy in enumerate(strategies)
        ]
        try:
            infos: list[dict[str, Any]] = ray.get([a.info.remote() for a in actors])
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            raise
        if upload_to is not None:
            read_fs, read_base = resolve_filesystem(upload_to, upload_filesystem)
        else:
            read_fs, read_base = pafs.LocalFileSystem(), str(root)
        return cls(actors, infos, urls, root, read_fs, read_base, load_refresh_s)

    @classmethod
    def attach(cls, name: str, load_refresh_s: float = 0.0) -> ProxyPool:
        """The pool another process of this Ray job started with ``name`` (its named actors),
        to run rollouts and sessions on from here (verl's agent loop workers); its shards are
        read from its ``out_root`` (a shared path), not from an upload. Shut it down where it
        was started."""
        import ray

        prefix = actor_name(name, 0)[:-1]
        found = []
        for entry in ray.util.list_named_actors(all_namespaces=False):
            actor = str(entry.get("name", "") if isinstance(entry, dict) else entry)
            if actor.startswith(prefix) and actor[len(prefix) :].isdigit():
                found.append(int(actor[len(prefix) :]))
        found.sort()
        if not found:
            raise ValueError(
                f"no proxy pool named {name!r} in this Ray job: start it with "
                f"ProxyPool.start(..., name={name!r}) first"
            )
        actors = [ray.get_actor(actor_name(name, i)) for i in found]
        infos: list[dict[str, Any]] = ray.get([a.info.remote() for a in actors])
        root = Path(infos[0]["out"]).parent
        urls: list[str] = ray.get(actors[0].policy_urls.remote())
        pool = cls(actors, infos, urls, root, pafs.LocalFileSystem(), str(root), load_refresh_s)
        pool._attached = True
        return pool

    # -- sessions ----------------------------------------------------------------------------
    def loads(self) -> list[dict[str, int]]:
        """Every actor's live sessions and calls in flight (polled now)."""
        import ray

        loads: list[dict[str, int]] = []
        for i, actor in enumerate(self.actors):
            if i in self._dead:
                loads.append({"sessions": 1 << 30, "dead": 1})  # never the least loaded
                continue
            try:
                loads.append(ray.get(actor.load.remote(), timeout=60))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._dead.add(i)
                loads.append({"sessions": 1 << 30, "dead": 1})
        with self._lock:
            self._loads, self._loads_at = loads, time.monotonic()
        return loads

    def open_session(
        self,
        metadata: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> PoolSession:
        """Open a session on the least-loaded actor (``session_id``: else a new one)."""
        import ray

        sid = session_id or f"s-{uuid.uuid4().hex}"
        if time.monotonic() - self._loads_at >= self.load_refresh_s:
            self.loads()
        with self._lock:
            if sid in self._where:
                raise ValueError(
                    f"session {sid!r} is open on {self.infos[self._where[sid]]['name']}"
                )
            index = least_loaded(self._loads, self._placed)
            self._placed[index] += 1
            self._where[sid] = index
        try:
            answer = ray.get(self.actors[index].open_session.remote(sid, metadata, limits))
        except BaseException:
            self._forget(sid)
            raise
        return PoolSession(
            self, answer["id"], index, answer["env"], answer["base_urls"], answer["api_key"]
        )

    def _forget(self, sid: str) -> int:
        with self._lock:
            index = self._where.pop(sid)
            self._placed[index] -= 1
        return index

    def proxy_of(self, session_id: str) -> int:
        """The index of the actor holding a session the pool opened (and has not closed)."""
        return self._where[session_id]

    def replica_for(self, session_id: str) -> str:
        """The policy replica the session's hash names (an idle proxy's choice, the same on
        every actor)."""
        return replica_for(session_id, self.policy_urls)

    def close_session(
        self, session_id: str, reward: float | dict[str, float] | None = None
    ) -> pa.Table:
        """Close it on its actor with its reward; its thread rows."""
        import ray

        index = self._where[session_id]
        table = ray.get(self.actors[index].close_session.remote(session_id, reward))
        self._forget(session_id)
        self._closed_on[session_id] = index
        return table

    def reward(self, session_id: str, reward: float | dict[str, float]) -> None:
        """A late reward for a session the pool closed (on the actor that held it)."""
        import ray

        ray.get(self.actors[self._holder(session_id)].reward.remote(session_id, reward))

    def advantage(
        self,
        session_id: str,
        advantage: float,
        step: int | None = None,
        step_s: float | None = None,
    ) -> None:
        """The trainer's own advantage for a session (and its step's time), to the actor that
        held it (its viewer)."""
        import ray

        actor = self.actors[self._holder(session_id)]
        ray.get(actor.advantage.remote(session_id, advantage, step, step_s))

    def _holder(self, session_id: str) -> int:
        """The actor that holds or held ``session_id``; KeyError if none did."""
        index = self._closed_on.get(session_id, self._where.get(session_id))
        if index is None and session_id in self._group_of:
            index = self._group_of[session_id][1]  # an agent of a rollout the pool ran
        if index is None:
            raise KeyError(f"the pool never held a session {session_id!r}")
        return index

    def sessions(self) -> list[dict[str, Any]]:
        """Every actor's live sessions (``GET /sessions``), each with its actor's ``proxy``."""

        found = self._each("sessions")
        return [{**s, PROXY_COLUMN: i} for i, live in found.items() for s in live]

    def stats(self) -> list[dict[str, Any]]:

        return list(self._each("stats").values())

    def flush(self) -> list[str]:

        return [p for written in self._each("flush").values() for p in written]

    def _each(self, method: str) -> dict[int, Any]:
        """``method`` called on every actor not found dead, by actor index; an actor that dies
        meanwhile is left out (and never used again)."""
        import ray

        refs = {
            i: getattr(a, method).remote() for i, a in enumerate(self.actors) if i not in self._dead
        }
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._dead.add(i)
        return out

    # -- weights -----------------------------------------------------------------------------
    def update_weights(
        self,
        path: str | os.PathLike[str],
        version: str,
        probe: dict[str, Any] | None = None,
        model: Any = None,
        tokenizer: Any = None,
        lora: bool = False,
    ) -> dict[str, Any]:
        """``AgentTap.update_weights`` for the pool: one actor makes every policy replica load
        ``path`` (checked against ``model``'s or ``probe``'s logprobs), then every other actor
        records calls from then on as sampled by ``version``. ``path`` must be readable by
        the policy servers and by that actor's node. Between the push and the last actor's
        label, that actor's calls in flight are labelled with the version before: push between
        training steps, with no rollout running (as TRL's loop does)."""
        import ray

        lora = lora or is_peft(model)
        probe = trainer_probe(probe, model, tokenizer)
        alive = [i for i in range(len(self.actors)) if i not in self._dead]
        if not alive:
            raise RuntimeError("no actor of the pool is alive: start a new pool")
        first, rest = alive[0], alive[1:]
        where = str(Path(path).resolve())
        answer: dict[str, Any] = ray.get(
            self.actors[first].update_weights.remote(where, str(version), probe, lora)
        )
        ray.get([self.actors[i].set_weight_version.remote(str(version)) for i in rest])
        return answer

    # -- the rows ----------------------------------------------------------------------------
    def shard_files(self, kind: str = "threads") -> list[str]:
        """Every proxy's finished ``kind`` shards (``turns``, ``threads``, ``failed``)."""
        return shard_files(self.read_fs, self.read_base, kind)

    def dataset(self, kind: str = "threads") -> ds.Dataset:
        """Every proxy's ``kind`` shards as one ``pyarrow.dataset``; a ``proxy`` column names
        the proxy folder (``proxy-<n>``) each row comes from. Rewards are those written at
        close; ``capture.storage.reader.load_threads`` joins late ones (per proxy folder)."""
        return open_dataset(self.read_fs, self.read_base, kind)

    def ray_dataset(self, kind: str = "threads") -> ray.data.Dataset:
        """The same shards as a Ray Data dataset (``ray.data.read_parquet``). Its read tasks
        need CPUs the proxy actors (``num_cpus`` each) have not taken, or it waits."""
        import ray.data

        files = self.shard_files(kind)
        if not files:
            raise FileNotFoundError(f"no {kind} shards under {self.read_base}")
        found = ray.data.read_parquet(files, filesystem=self.read_fs)
        lost = self.lost_sessions()
        if lost and kind != "rewards":
            found = found.filter(lambda row: row["session_id"] not in lost)
        return found

    # -- lifecycle ---------------------------------------------------------------------------
    def shutdown(self, timeout: float = 120.0) -> None:
        """Stop every instance (its shards written and uploaded), then the actors. An actor
        killed otherwise takes its mitmdump with it (Ray ends a worker's children) before it
        wrote its live sessions: their journals become shards when a proxy starts again on
        the same folder (crash recovery)."""
        import ray

        if self._stopped or self._attached:
            return
        self._stopped = True
        try:
            # Each instance is killed past its share, so the actors answer within ``timeout``.
            stops = [
                a.shutdown.remote(max(1.0, timeout - 15))
                for i, a in enumerate(self.actors)
                if i not in self._dead
            ]
            deadline = time.monotonic() + timeout
            for ref in stops:  # one by one: an actor lost since does not cut the others short
                try:
                    ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
                except ray.exceptions.RayActorError:
                    pass
        finally:
            for actor in self.actors:
                ray.kill(actor)

    def __enter__(self) -> ProxyPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
