"""``ProxyPool``'s groups of rollouts (capture/client/ray_pool.py, docs/API.md "Rollouts on Ray"):
``rollout`` and its async and polling forms, the group's files, the capacities placement reads
and the sessions lost with their node. The pool's own state (its actors, the ones found dead,
its groups, the lost list) is ``ProxyPool``'s; the placing and watching is
capture/client/pool_rollouts.py's."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from capture.client.pool_rollouts import Capacity, GroupRun, GroupRunner
from capture.client.pool_shards import lost_session_ids, save_lost
from capture.client.proxy_actor import rollout_need_mb
from capture.client.shipping import Packed, pack_folder


class PoolGroups:
    """The rollout half of ``ProxyPool`` (a mixin: the attributes below are the pool's)."""

    actors: list[Any]
    out_root: Path
    read_fs: pafs.FileSystem
    read_base: str
    _lock: threading.Lock
    _dead: set[int]
    _groups: dict[str, GroupRun]
    _group_of: dict[str, tuple[str, int]]
    _lost: list[dict[str, Any]]

    def capacities(self, image: str | None = None) -> list[Capacity]:
        """What each alive actor's node can run now (``ProxyActor.capacity``)."""
        return self._capacities(set(), image)

    def _capacities(self, skip: set[int], image: str | None = None) -> list[Capacity]:
        import ray

        alive = [i for i in range(len(self.actors)) if i not in self._dead | skip]
        refs = {i: self.actors[i].capacity.remote(image) for i in alive}
        out = []
        for i, ref in refs.items():
            try:
                out.append(Capacity.of(ray.get(ref, timeout=60)))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._dead.add(i)
        return out

    def rollout(
        self,
        agent: str | dict[str, list[str]],
        prompt: str = "",
        n: int = 1,
        *,
        workdir: str | os.PathLike[str] | None = None,
        image: str | None = None,
        cwd: str | None = None,
        task: str | os.PathLike[str] | None = None,
        verifier: list[str] | dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        id: str | None = None,
        seed: int | None = None,
        rows: bool = True,
        wait: bool = True,
        retries: int = 0,
        **fields: Any,
    ) -> dict[str, Any]:
        """Run ``n`` agents as one group across the pool's nodes: ``POST /rollouts``'s
        arguments (``AgentTap.rollout``; other body fields such as ``sandbox`` or ``egress`` as
        keywords), each node running its share through its own agenttap. The folders given
        (``workdir``, ``task``, a verifier's ``tests``) are shipped to the nodes through Ray's
        object store. The answer is ``POST /rollouts``'s, each rollout naming its ``node`` (Ray
        node id) and ``proxy`` (actor index); a rollout whose node is lost ends
        ``finish_reason: "node_lost"``, or with ``retries`` runs again on another node under a
        new session id (docs/API.md "Rollouts on Ray"). ``wait=False``: the answer at once
        (``status`` "running"); ``get_rollout`` gives it later."""
        if not isinstance(n, int) or n < 1:
            raise ValueError("n must be a whole number from 1")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError("retries must be a whole number from 0")
        rid = id or f"r-{uuid.uuid4().hex[:12]}"
        with self._lock:
            if rid in self._groups:
                raise ValueError(f"rollout id {rid!r} is in use in this pool: give another")
        body: dict[str, Any] = {"agent": agent, "prompt": prompt, "wait": True, "rows": rows}
        if task is not None and not prompt:
            del body["prompt"]  # the task's instruction
        given = {
            "limits": limits, "metadata": metadata, "timeout_s": timeout_s, "seed": seed,
            "image": image, "cwd": cwd,
            "verifier": (
                {"command": verifier} if isinstance(verifier, list) and verifier else verifier
            ),
            **fields,
        }  # fmt: skip
        body.update({k: v for k, v in given.items() if v is not None})
        packed: dict[str, Packed] = {}
        if workdir is not None:
            packed["workdir"] = pack_folder(workdir)
        if task is not None:
            packed["task"] = pack_folder(task)
        check = body.get("verifier")
        tests = check.get("tests") if isinstance(check, dict) else None
        if tests is not None:
            packed["tests"] = pack_folder(tests)
        group = GroupRun(rid, agent, n, retries)
        runner = GroupRunner(
            group, body, packed, self.actors, self._capacities_for(image),
            self._mark_lost, rollout_need_mb(limits), image is not None or task is not None,
        )  # fmt: skip
        with self._lock:
            self._groups[rid] = group
        thread = threading.Thread(target=runner.run, name=f"agenttap-group-{rid}", daemon=True)
        thread.start()
        if not wait:
            return group.summary()
        group.done.wait()
        return self._answer(group)

    async def rollout_async(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``rollout`` from a coroutine (it waits in a worker thread)."""
        import asyncio

        return await asyncio.to_thread(self.rollout, *args, **kwargs)

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        """A group's answer so far (``status`` "running" until every rollout has ended)."""
        group = self._groups.get(rollout_id)
        if group is None:
            raise KeyError(f"the pool ran no rollout {rollout_id!r}")
        return self._answer(group) if group.done.is_set() else group.summary()

    def rollout_files(
        self, rollout_id: str, dest: str | os.PathLike[str] | None = None
    ) -> list[Path]:
        """Copy each node's folder of a group (its agents' logs, kept work folders, verifier
        output: ``OUT/rollouts/ID/I/``, retries' folders too) from the actors that ran it to
        ``dest`` (default ``OUT_ROOT/files/``); the folders written, ``DEST/proxy-<n>/ID``."""
        import io
        import tarfile

        import ray

        group = self._groups.get(rollout_id)
        if group is None or not group.done.is_set():
            raise KeyError(f"the pool has no ended rollout {rollout_id!r}")
        where: dict[tuple[int, str], None] = {}
        for run in group.runs.values():
            if run.get("finish_reason") != "node_lost" and run.get("proxy") is not None:
                rid = str(run["session_id"]).rsplit("-", 1)[0]
                where[(int(run["proxy"]), rid)] = None
        root = Path(dest) if dest is not None else self.out_root / "files"
        written = []
        for actor, rid in where:
            data = ray.get(self.actors[actor].rollout_files.remote(rid))
            target = root / f"proxy-{actor}"
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
                tar.extractall(target, filter="data")
            written.append(target / rid)
        return written

    def _answer(self, group: GroupRun) -> dict[str, Any]:
        if group.error is not None:
            raise group.error
        answer = group.summary()
        with self._lock:
            for run in answer["rollouts"]:
                if run.get("finish_reason") != "node_lost" and run.get("proxy") is not None:
                    self._group_of[str(run["session_id"])] = (group.id, int(run["proxy"]))
        return answer

    def _capacities_for(self, image: str | None) -> Any:
        def capacities(skip: set[int]) -> list[Capacity]:
            return self._capacities(skip, image)

        return capacities

    def _mark_lost(self, actor: int, sessions: list[str], why: str) -> None:
        """An actor found dead while it ran ``sessions``: never placed on again; the sessions
        written to the pool's lost list (their rows never read back)."""
        with self._lock:
            self._dead.add(actor)
            self._lost.append(
                {"proxy": actor, "session_ids": sessions, "why": why, "at": time.time()}
            )
            entries = list(self._lost)
        save_lost(self.read_fs, self.read_base, entries)

    def lost_sessions(self) -> set[str]:
        """Session ids of rollout attempts lost with their node (their rows never read)."""
        with self._lock:
            return lost_session_ids(self._lost)
