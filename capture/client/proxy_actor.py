"""The actor side of a proxy pool (``capture/client/ray_pool.py``): ``ProxyActor``, one agenttap
instance started through ``capture.client.launcher.AgentTap`` on its node and driven through the
control API, and ``proxy_actor_class``, the same as a Ray actor class."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from capture.client.launcher import AgentTap, AgentTapError
from capture.client.pool_shards import Uploader, resolve_filesystem
from capture.client.shipping import Packed, unpack_folder
from capture.isolation.limits import LIMIT_BY_KEY

# A node's container engine: podman when it is on PATH; this variable set to "none" in a node's
# environment keeps image rollouts off it (a node whose podman is not to be used).
ENGINE_ENV = "AGENTTAP_CONTAINER_ENGINE"
# The share of the host's memory the instance promises its rollouts (agenttap_rollout_memory_mb's
# default, capture/rollouts/admission.py).
MEMORY_SHARE = 0.8
# How long a rollout refused for the instance's cap on agents at once (429) waits to try again.
BUSY_RETRY_S = 1.0


class ProxyActor:
    """One agenttap instance on this node: the class each Ray actor runs (``proxy_actor_class``;
    a plain instance works without Ray). Its shards go to ``OUT_ROOT/proxy-<index>/``."""

    def __init__(
        self,
        index: int,
        policy_urls: list[str],
        tokenizer: str,
        out_root: str,
        *,
        host: str = "127.0.0.1",
        advertise_host: str = "",
        confdir: str | None = None,
        options: dict[str, str] | None = None,
        upload_to: str | None = None,
        upload_filesystem: pafs.FileSystem | None = None,
        start_timeout: float = 120.0,
    ) -> None:
        self.index = index
        self.urls = list(policy_urls)
        self.name = f"proxy-{index}"
        self.out = Path(out_root) / self.name
        if host == "node":
            host = _node_ip()
        # The proxy's CA (its private key) stays on this node, not in the shared out root.
        conf = confdir or tempfile.mkdtemp(prefix=f"agenttap-{self.name}-conf-")
        self.tap = AgentTap.start(
            ",".join(policy_urls),
            tokenizer,
            self.out,
            host=host,
            advertise_host=advertise_host,
            confdir=conf,
            options=options,
            timeout=start_timeout,
        )
        self.uploader: Uploader | None = None
        if upload_to is not None:
            fs, base = resolve_filesystem(upload_to, upload_filesystem)
            self.uploader = Uploader(self.out, fs, f"{base}/{self.name}")
        self.opened = 0
        self.closed = 0
        self._lock = threading.Lock()
        opts = options or {}
        budget = opts.get("agenttap_rollout_memory_mb")
        self.memory_mb = int(budget) if budget else int(_host_memory_mb() * MEMORY_SHARE)
        self.engine = _container_engine()
        # Rollout id -> the memory its agents were promised (n x (memory_mb + disk_mb)).
        self._held: dict[str, int] = {}

    def info(self) -> dict[str, Any]:
        """Where it runs: its index, folder, node, pid, and the instance's URLs."""
        return {
            "index": self.index,
            "name": self.name,
            "out": str(self.out),
            "node_id": _node_id(),
            "node_ip": _node_ip(),
            "pid": os.getpid(),
            "mitmdump_pid": self.tap.proc.pid,
            "proxy_url": self.tap.proxy_url,
            "api_url": self.tap.api_url,
        }

    def policy_urls(self) -> list[str]:
        return self.urls

    def open_session(
        self,
        session_id: str,
        metadata: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        sess = self.tap.open_session(session_id, metadata, limits)
        with self._lock:
            self.opened += 1
        return {
            "id": sess.id,
            "env": dict(sess.env),
            "base_urls": dict(sess.base_urls),
            "api_key": sess.api_key,
        }

    def close_session(
        self, session_id: str, reward: float | dict[str, float] | None = None
    ) -> pa.Table:
        """Close it with its reward: its thread rows (uploaded first, with ``upload_to``)."""
        body = {"reward": reward} if reward is not None else {}
        summary, table = self.tap.client.request(
            "POST", f"/sessions/{session_id}/close", body, arrow=True
        )
        assert table is not None
        with self._lock:
            self.closed += 1
        if self.uploader is not None:
            self.uploader.sync()
        return table

    def advantage(
        self,
        session_id: str,
        advantage: float,
        step: int | None = None,
        step_s: float | None = None,
    ) -> None:
        """The trainer's own advantage for a session of this proxy, for its viewer."""
        self.tap.advantage(session_id, advantage, step, step_s)

    def reward(self, session_id: str, reward: float | dict[str, float]) -> None:
        """A late reward, after close (written to this proxy's ``rewards/``)."""
        self.tap.client.post(f"/sessions/{session_id}/reward", {"reward": reward})
        if self.uploader is not None:
            self.uploader.sync()

    def load(self) -> dict[str, int]:
        """Live sessions and calls in flight now (the control API's ``GET /sessions``)."""
        live = self.tap.sessions()
        return {"sessions": len(live), "in_flight": sum(int(s["in_flight"]) for s in live)}

    def sessions(self) -> list[dict[str, Any]]:
        return self.tap.sessions()

    def flush(self) -> list[str]:
        """Write every live session's shards now (and upload them)."""
        written = self.tap.flush()
        if self.uploader is not None:
            self.uploader.sync()
        return written

    def capacity(self, image: str | None = None) -> dict[str, Any]:
        """What this node can run now: its rollouts' memory budget and what the rollouts this
        actor runs hold of it, its CPUs, its container engine ("" for none) and whether
        ``image`` is already there (a warm image starts without a build or pull)."""
        with self._lock:
            held, running = sum(self._held.values()), len(self._held)
        warm = None
        if image and self.engine:
            try:
                found = subprocess.run(
                    [self.engine, "image", "exists", image], capture_output=True, timeout=30
                )
                warm = found.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                warm = False
        return {
            "index": self.index,
            "node_id": _node_id(),
            "cpus": os.cpu_count() or 1,
            "memory_mb": self.memory_mb,
            "held_mb": held,
            "rollouts": running,
            "engine": self.engine,
            "image_warm": warm,
        }

    def run_rollout(
        self,
        body: dict[str, Any],
        workdir: Packed | None = None,
        task: Packed | None = None,
        tests: Packed | None = None,
    ) -> dict[str, Any]:
        """``POST /rollouts`` with ``body`` on this instance, waiting for its end; the folders
        the driver shipped (a seed workdir, a task folder, a verifier's tests) unpacked on this
        node first and named by their paths here. Its answer, each rollout naming its ``node``
        and ``proxy``."""
        body = dict(body)
        if workdir is not None:
            body["workdir"] = str(unpack_folder(workdir))
        if task is not None:
            body["task"] = str(unpack_folder(task))
        if tests is not None:
            body["verifier"] = {**body["verifier"], "tests": str(unpack_folder(tests))}
        rollout_id = str(body["id"])
        with self._lock:
            self._held[rollout_id] = int(body.get("n", 1)) * rollout_need_mb(body.get("limits"))
        try:
            while True:
                try:
                    answer, _ = self.tap.client.request("POST", "/rollouts", body, timeout=None)
                    break
                except AgentTapError as exc:
                    if exc.status != 429:  # not "too many agents at once": the caller's to see
                        raise
                    time.sleep(BUSY_RETRY_S)
        finally:
            with self._lock:
                self._held.pop(rollout_id, None)
        node = _node_id()
        for run in answer.get("rollouts") or []:
            run["node"] = node
            run["proxy"] = self.index
        if self.uploader is not None:
            self.uploader.sync()
        return answer

    def update_weights(
        self, path: str, version: str, probe: dict[str, Any] | None, lora: bool
    ) -> dict[str, Any]:
        """``AgentTap.update_weights`` on this instance: the policy servers load ``path``."""
        return self.tap.update_weights(path, version, probe=probe, lora=lora)

    def set_weight_version(self, version: str) -> dict[str, Any]:
        """``AgentTap.set_weight_version``: another actor pushed them; calls from now on are
        recorded as sampled by ``version``."""
        return self.tap.set_weight_version(version)

    def rollout_files(self, rollout_id: str) -> bytes:
        """A rollout's folder on this node (each agent's logs, kept work folder, verifier
        output) as one tar."""
        folder = self.out / "rollouts" / rollout_id
        if not folder.is_dir() or "/" in rollout_id or rollout_id in ("", ".", ".."):
            raise FileNotFoundError(f"{self.name} holds no rollout {rollout_id!r}")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(folder, arcname=rollout_id)
        return buf.getvalue()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = {"opened": self.opened, "closed": self.closed}
        return {
            **self.info(),
            **counts,
            **self.load(),
            "uploaded": self.uploader.uploaded if self.uploader else 0,
            "alive": self.tap.proc.poll() is None,
        }

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the instance (every session's shards written; killed past ``timeout``), then
        upload what is left."""
        self.tap.close(timeout)
        if self.uploader is not None:
            self.uploader.sync()


def proxy_actor_class(num_cpus: float = 1.0, max_concurrency: int = 64) -> Any:
    """``ProxyActor`` as a Ray actor class (Ray is imported here, not when this module is).
    ``max_concurrency``: its methods run in a thread pool, so ``load`` answers while a close
    is under way."""
    import ray

    remote: Any = ray.remote  # its typed overloads name no actor options
    return remote(num_cpus=num_cpus, max_concurrency=max_concurrency)(ProxyActor)


def rollout_need_mb(limits: Any) -> int:
    """What one agent of a rollout with these ``"limits"`` is promised on its node: its memory
    and its tmpfs (capture/rollouts/admission.py ``run_need_mb``), defaults where not given."""
    given = limits if isinstance(limits, dict) else {}
    total = 0
    for key in ("memory_mb", "disk_mb"):
        value = given.get(key, LIMIT_BY_KEY[key].default)
        total += int(value) if isinstance(value, int | float) else int(LIMIT_BY_KEY[key].default)
    return total


def _host_memory_mb() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def _container_engine() -> str:
    """This node's container engine's path ("" for none)."""
    if os.environ.get(ENGINE_ENV, "").strip().lower() == "none":
        return ""
    return shutil.which("podman") or ""


def _node_id() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""
    except Exception:
        return ""


def _node_ip() -> str:
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:
        return "127.0.0.1"
