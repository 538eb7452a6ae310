"""The actor side of a proxy pool (``capture/client/ray_pool.py``): ``ProxyActor``, one agenttap
instance started through ``capture.client.launcher.AgentTap`` on its node and driven through the
control API, and ``proxy_actor_class``, the same as a Ray actor class."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from capture.client.launcher import AgentTap
from capture.client.pool_shards import Uploader, resolve_filesystem


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
