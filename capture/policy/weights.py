"""New weights for the policy servers: ``POST /policy/weights`` and ``POST /policy/version``.

A trainer saves its model (``save_pretrained``: safetensors + config) and asks agenttap to serve
it. Each replica of agenttap_policy_url's pool, all at once:

1. is marked as loading the new version (``VLLMClient.incoming_version``): a generation started
   from here on is labelled with it, since it can only run once the new weights serve;
2. ``POST /pause?mode=abort``: vLLM ends the generations running there with ``finish_reason:
   abort`` and every token so far; agenttap resubmits each at once (``stream_resuming``), and
   the resubmissions wait in vLLM's queue while it is paused. The client's stream never breaks;
3. ``POST /collective_rpc`` ``reload_weights(weights_path=DIR)``: vLLM loads the folder in place
   (no restart, its compiled graphs kept; a fraction of a second for a small model);
4. ``POST /reset_prefix_cache``: cached prefixes were computed by the old weights;
5. ``POST /update_weight_version``: vLLM's own label (its generate endpoint reports it);
6. ``POST /resume``: the waiting generations run, on the new weights, their prompts (the tokens
   sampled before the update included) prefilled again.

So a generation that spans an update has two spans in its ``weight_versions``: the tokens before
the pause under the old label, the rest under the new one. These routes need vLLM's dev mode
(``VLLM_SERVER_DEV_MODE=1``, which ``python -m rewriter.policy_server`` sets).

``WeightHistory`` counts the versions served, for ``agenttap_max_staleness``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from capture.policy.replicas import Replica, ReplicaSet
from rewriter.vllm_client import DEFAULT_WEIGHT_VERSION, VLLMClient

logger = logging.getLogger(__name__)

# A reload of a large model can take minutes; the pause and the rest are quick.
RELOAD_TIMEOUT_S = 1800.0
STEP_TIMEOUT_S = 120.0
# What a version label may be: it names weights in rows, logs and metrics.
MAX_VERSION_CHARS = 128


class WeightUpdateError(RuntimeError):
    """Some replica could not load the weights; ``replicas``: each one's outcome."""

    def __init__(self, message: str, replicas: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.replicas = replicas


@dataclass
class WeightHistory:
    """The weight versions served, oldest first; the last is the current one."""

    versions: list[str] = field(default_factory=lambda: [DEFAULT_WEIGHT_VERSION])
    updated_at: float = 0.0

    @property
    def current(self) -> str:
        return self.versions[-1]

    @property
    def index(self) -> int:
        """How many updates came before the current version (staleness counts in these)."""
        return len(self.versions) - 1

    def add(self, version: str) -> None:
        if version != self.current:
            self.versions.append(version)
        self.updated_at = time.time()

    def summary(self) -> dict[str, Any]:
        return {
            "version": self.current,
            "index": self.index,
            "updated_at": self.updated_at or None,
            "versions": self.versions[-16:],
        }


def check_version(value: Any) -> str:
    """A version label from a request body; ValueError says what is wanted."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise ValueError('"version" must be a string such as "step-12"')
    version = str(value)
    if not version or len(version) > MAX_VERSION_CHARS or not version.isprintable():
        raise ValueError(
            f'"version" must be 1 to {MAX_VERSION_CHARS} printable characters, such as "step-12"'
        )
    return version


def check_weights_dir(value: Any) -> Path:
    """The folder a trainer's ``save_pretrained`` wrote; ValueError says what is wrong."""
    if not isinstance(value, str) or not value:
        raise ValueError('"path" must be the folder save_pretrained wrote (an absolute path)')
    path = Path(value)
    if not path.is_absolute():
        raise ValueError(
            f'"path" must be absolute (the policy servers resolve it, not the caller): {value!r}'
        )
    if not path.is_dir():
        raise ValueError(f"no folder {value!r} here: save the weights first, then post them")
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{value!r} holds no .safetensors file: save with "
            "model.save_pretrained(DIR, safe_serialization=True)"
        )
    return path


async def _post(
    client: VLLMClient, path: str, body: Any = None, timeout_s: float = STEP_TIMEOUT_S
) -> None:
    """POST ``path`` on ``client``'s server, over its own connection pool (TCP or its unix
    socket)."""
    url = f"{client.base_url}{path}"  # as errors name it
    try:
        async with asyncio.timeout(timeout_s):
            body = body if body is not None else {}
            async with client.session.post(client.url(path), json=body) as resp:
                text = await resp.text()
                status = resp.status
    except TimeoutError:
        raise RuntimeError(f"POST {url} did not answer in {timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise RuntimeError(f"POST {url} failed: {exc}") from None
    if status == 404:
        raise RuntimeError(
            f"POST {url} answered 404: this vLLM has no weight-update routes; start it with "
            "VLLM_SERVER_DEV_MODE=1 (python -m rewriter.policy_server does)"
        )
    if status != 200:
        raise RuntimeError(f"POST {url} answered {status}: {text[:300]}")


async def load_on_replica(replica: Replica, path: Path, version: str) -> dict[str, Any]:
    """Steps 2-6 of the module docstring on one replica; its outcome (never raises)."""
    started = time.monotonic()
    client = replica.client
    outcome: dict[str, Any] = {"url": replica.url, "version": client.weight_version}
    try:
        await _post(client, "/pause?mode=abort")
    except RuntimeError as exc:
        replica.client.failed_versions.add(version)
        outcome.update(ok=False, error=str(exc), seconds=round(time.monotonic() - started, 3))
        return outcome
    try:
        await _post(
            client,
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            timeout_s=RELOAD_TIMEOUT_S,
        )
        await _post(client, "/reset_prefix_cache")
        await _post(client, "/update_weight_version", {"new_version": version})
        replica.client.weight_version = version
        replica.client.failed_versions.discard(version)
        outcome.update(ok=True, version=version)
    except RuntimeError as exc:
        # Before the resume: what ran meanwhile ran on the weights it kept.
        replica.client.failed_versions.add(version)
        outcome.update(ok=False, error=str(exc))
    finally:
        try:
            # Never left paused: its queued generations would wait forever.
            await _post(client, "/resume")
        except RuntimeError as exc:
            outcome.update(ok=False, error=f"{outcome.get('error', '')} {exc}".strip())
    outcome["seconds"] = round(time.monotonic() - started, 3)
    return outcome


class PolicyWeights:
    """One weight update at a time, on every replica of a pool."""

    def __init__(self) -> None:
        self.history = WeightHistory()
        self._lock = asyncio.Lock()

    async def update(
        self, http: aiohttp.ClientSession | None, replicas: ReplicaSet, path: Path, version: str
    ) -> list[dict[str, Any]]:
        """Every replica serves ``path`` as ``version`` once this returns; each one's outcome.
        Raises WeightUpdateError if one failed (the others serve the new weights). Each
        replica is reached through its own client's connection pool (a unix socket's
        server has its own); ``http``, the pool's shared session callers pass, is not needed."""
        async with self._lock:
            targets = list(replicas.replicas.values())
            for replica in targets:
                replica.client.incoming_version = version
            try:
                outcomes = await asyncio.gather(
                    *(load_on_replica(r, path, version) for r in targets)
                )
            finally:
                for replica in targets:
                    replica.client.incoming_version = None
            ok = [o for o in outcomes if o["ok"]]
            if ok:
                self.history.add(version)
            failed = [o for o in outcomes if not o["ok"]]
            if failed:
                raise WeightUpdateError(
                    f"{len(failed)} of {len(outcomes)} policy servers did not load {path} "
                    f"({failed[0]['url']}: {failed[0]['error']}); the others serve {version!r}",
                    list(outcomes),
                )
            logger.info(
                "agenttap: the policy serves weights %r from %s (%d server(s), %.2f s)",
                version,
                path,
                len(outcomes),
                max((o["seconds"] for o in outcomes), default=0.0),
            )
            return list(outcomes)

    async def set_version(
        self, http: aiohttp.ClientSession | None, replicas: ReplicaSet, version: str
    ) -> list[dict[str, Any]]:
        """A trainer pushed weights to the servers itself: calls from now on are labelled
        ``version``. vLLM's own label is set too where it has the route (best effort; through
        each replica's client, as in ``update``)."""
        async with self._lock:
            outcomes: list[dict[str, Any]] = []
            for replica in replicas.replicas.values():
                replica.client.weight_version = version
                try:
                    await _post(replica.client, "/update_weight_version", {"new_version": version})
                    outcomes.append({"url": replica.url, "version": version, "vllm_label": True})
                except RuntimeError:
                    outcomes.append({"url": replica.url, "version": version, "vllm_label": False})
            self.history.add(version)
            return outcomes
