"""New weights for the policy servers: ``POST /policy/weights`` and ``POST /policy/version``.

A trainer saves its model (``save_pretrained``: safetensors + config) and asks agenttap to serve
it. Each replica of agenttap_policy_url's pool, all at once:

1. leaves rotation (``loading``) and holds new generations agenttap sends it
   (its ``Replica.rotation.hold``); a generation started from here on is labelled with the new
   version (``rotation.incoming_version``), since it can only run once the new weights serve;
2. ``POST /pause?mode=abort``: vLLM ends the generations running there with ``finish_reason:
   abort`` and every token so far; agenttap resubmits each (``stream_resuming``), and the
   resubmissions wait in agenttap's hold. The client's stream never breaks;
3. ``POST /collective_rpc`` ``agenttap_reload_weights(weights_path=DIR)`` where the server has
   agenttap's worker extension (policy_server/worker.py: vLLM's reload, then the output layer
   a tied checkpoint leaves stale on a CPU prepared again), else vLLM's ``reload_weights``: the
   folder loads in place (no restart, its compiled graphs kept);
4. ``POST /reset_prefix_cache``: cached prefixes were computed by the old weights;
5. ``POST /update_weight_version``: vLLM's own label (its generate endpoint reports it);
6. ``POST /resume``, then the check: with a probe (a short token sequence and the trainer's
   own logprobs for it), the replica's ``prompt_logprobs`` for it must be within
   ``agenttap_weights_tolerance``; a replica past it stays out of rotation (``unverified``,
   the difference named in ``/replicas`` and in the route's 502), and the generations held
   for it go to a replica that passed. Then its fingerprint is taken (the probe's logprobs, or
   agenttap's own sequence's without a probe) and it rejoins rotation: the held generations
   run, on the new weights, their prompts (the tokens sampled before the update included)
   prefilled again.

So a generation that spans an update has two spans in its ``weight_versions``: the tokens before
the pause under the old label, the rest under the new one. These routes need vLLM's dev mode
(``VLLM_SERVER_DEV_MODE=1``, which ``python -m policy_server`` sets).

The fingerprint is compared again at every health check and every ``agenttap_weights_check_s``
(capture/policy/replicas.py): weights loaded behind agenttap's back take the replica out of
rotation, and the window since its last good check is reported (``unverified_windows``).

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

from capture.policy.replicas import Replica, ReplicaSet, max_abs_diff
from rewriter.vllm_client import DEFAULT_WEIGHT_VERSION, VLLMClient

logger = logging.getLogger(__name__)

# A reload of a large model can take minutes; the pause and the rest are quick.
RELOAD_TIMEOUT_S = 1800.0
STEP_TIMEOUT_S = 120.0
# What a version label may be: it names weights in rows, logs and metrics.
MAX_VERSION_CHARS = 128
# A probe's length: long enough to exercise every layer, short enough to check in a moment.
MIN_PROBE_IDS, MAX_PROBE_IDS = 2, 4096
# vLLM's answer where the worker has no agenttap extension (policy_server/worker.py).
NO_EXTENSION = "has no attribute 'agenttap_reload_weights'"


@dataclass(frozen=True)
class Probe:
    """A short token sequence and the trainer's logprob of each token given the ones before
    it (entry 0: None, nothing comes before it)."""

    ids: list[int]
    logprobs: list[float | None]

    def summary(self) -> dict[str, Any]:
        return {"tokens": len(self.ids)}


def check_probe(value: Any) -> Probe | None:
    """A probe from a request body (None: none given); ValueError says what is wanted."""
    if value is None:
        return None
    shape = (
        '"probe" must be {"ids": [token ids], "logprobs": [the trainer model\'s logprob of '
        "each id given the ones before it, the first null]} (capture.train.probe computes it)"
    )
    if not isinstance(value, dict) or set(value) - {"ids", "logprobs"}:
        raise ValueError(shape)
    ids, logprobs = value.get("ids"), value.get("logprobs")
    if not isinstance(ids, list) or not isinstance(logprobs, list):
        raise ValueError(shape)
    if not MIN_PROBE_IDS <= len(ids) <= MAX_PROBE_IDS or len(logprobs) != len(ids):
        raise ValueError(
            f'"probe": {MIN_PROBE_IDS} to {MAX_PROBE_IDS} ids and one logprob per id '
            f"(got {len(ids)} ids, {len(logprobs)} logprobs)"
        )
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < 2**31 for i in ids):
        raise ValueError('"probe": "ids" must be token ids (whole numbers, 0 or more)')
    out: list[float | None] = [None]
    for lp in logprobs[1:]:
        if not isinstance(lp, int | float) or isinstance(lp, bool) or not -1e9 < lp <= 0:
            raise ValueError('"probe": "logprobs" after the first must be numbers, 0 or less')
        out.append(float(lp))
    return Probe(list(ids), out)


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


# The update's steps that may be sent again when the connection dropped before an answer:
# asking twice does what asking once does.
IDEMPOTENT = ("/pause", "/resume", "/reset_prefix_cache", "/update_weight_version")


async def _post(
    client: VLLMClient, path: str, body: Any = None, timeout_s: float = STEP_TIMEOUT_S
) -> None:
    """POST ``path`` on ``client``'s server, over its own connection pool (TCP or its unix
    socket). An idempotent step whose connection dropped before it was answered (a pooled
    connection the server had just closed: a broken pipe) is sent once more, on a new one."""
    url = f"{client.base_url}{path}"  # as errors name it
    tries = 2 if path.startswith(IDEMPOTENT) else 1
    for attempt in range(1, tries + 1):
        try:
            async with asyncio.timeout(timeout_s):
                body = body if body is not None else {}
                async with client.session.post(client.url(path), json=body) as resp:
                    text = await resp.text()
                    status = resp.status
            break
        except TimeoutError:
            raise RuntimeError(f"POST {url} did not answer in {timeout_s:g} s") from None
        except aiohttp.ClientConnectionError as exc:
            if attempt < tries:
                logger.info("agenttap: POST %s lost its connection (%s): sent again", url, exc)
                continue
            raise RuntimeError(f"POST {url} failed: {exc}") from None
        except aiohttp.ClientError as exc:
            raise RuntimeError(f"POST {url} failed: {exc}") from None
    if status == 404:
        raise RuntimeError(
            f"POST {url} answered 404: this vLLM has no weight-update routes; start it with "
            "VLLM_SERVER_DEV_MODE=1 (python -m policy_server does)"
        )
    if status != 200:
        raise RuntimeError(f"POST {url} answered {status}: {text[:300]}")


def check_lora_dir(value: Any) -> Path:
    """The folder a PEFT model's ``save_pretrained`` wrote (the adapter alone); ValueError says
    what is wrong."""
    if not isinstance(value, str) or not value:
        raise ValueError('"lora" must be the folder a PEFT model\'s save_pretrained wrote')
    path = Path(value)
    if not path.is_absolute():
        raise ValueError(
            f'"lora" must be absolute (the policy servers resolve it, not the caller): {value!r}'
        )
    if not (path / "adapter_config.json").is_file():
        raise ValueError(
            f"{value!r} holds no adapter_config.json: save the PEFT model "
            "(model.save_pretrained(DIR) on a PeftModel writes the adapter alone)"
        )
    return path


async def _load_lora(replica: Replica, path: Path, version: str) -> None:
    """Step 3 for a LoRA adapter: vLLM's runtime LoRA loading, the adapter named ``version``;
    generations ask for it by that name from now on (``rotation.lora``)."""
    client = replica.client
    if replica.rotation.lora == version:  # the same label again: the old one goes first
        try:
            await _post(client, "/v1/unload_lora_adapter", {"lora_name": version})
        except RuntimeError:
            pass
    try:
        await _post(
            client,
            "/v1/load_lora_adapter",
            {"lora_name": version, "lora_path": str(path)},
            timeout_s=RELOAD_TIMEOUT_S,
        )
    except RuntimeError as exc:
        if "404" in str(exc) or "405" in str(exc):
            raise RuntimeError(
                f"{exc}; serve LoRA adapters with vLLM's --enable-lora --max-lora-rank N and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (python -m policy_server "
                "--max-lora-rank N)"
            ) from None
        raise
    replica.rotation.lora = version


async def _unload_lora(replica: Replica, name: str | None) -> None:
    """The adapter served before this one, unloaded (best effort: it only takes memory)."""
    client = replica.client
    if name is None or name == replica.rotation.lora:
        return
    try:
        await _post(client, "/v1/unload_lora_adapter", {"lora_name": name})
    except RuntimeError as exc:
        logger.info("agenttap: %s kept LoRA adapter %r (%s)", client.base_url, name, exc)


async def _reload(replica: Replica, path: Path) -> None:
    """Step 3 of the module docstring: agenttap's exact reload where the server has it, vLLM's
    own where it does not (then the probe is what says whether the weights serve whole)."""
    client, rotation = replica.client, replica.rotation
    if rotation.exact_reload is not False:
        try:
            await _post(
                client,
                "/collective_rpc",
                {"method": "agenttap_reload_weights", "kwargs": {"weights_path": str(path)}},
                timeout_s=RELOAD_TIMEOUT_S,
            )
            rotation.exact_reload = True
            return
        except RuntimeError as exc:
            if NO_EXTENSION not in str(exc):
                raise
            rotation.exact_reload = False
            logger.warning(
                "agenttap: the policy server at %s has no agenttap_reload_weights (vLLM's "
                "--worker-extension-cls policy_server.worker.AgentTapWorker, which python -m "
                "policy_server sets): its weights load with vLLM's reload_weights, "
                "which on a CPU leaves a tied output layer (tie_word_embeddings) as it was; "
                "pass a probe to POST /policy/weights to have every update checked",
                client.base_url,
            )
    await _post(
        client,
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
        timeout_s=RELOAD_TIMEOUT_S,
    )


async def fingerprint(
    replicas: ReplicaSet, replica: Replica, ids: list[int], timeout_s: float = STEP_TIMEOUT_S
) -> list[float | None]:
    """The replica's prompt logprobs for ``ids`` (bypassing its hold: it runs while the
    replica's generations wait), kept as its fingerprint."""
    async with asyncio.timeout(timeout_s):
        answers = await replica.client.prompt_logprobs(ids, check=True)
    replica.fingerprint_ids = list(ids)
    replica.fingerprint = answers
    replica.fingerprint_at = replica.verified_at = time.time()
    return answers


async def load_on_replica(
    replicas: ReplicaSet,
    replica: Replica,
    path: Path,
    version: str,
    probe: Probe | None = None,
    lora: bool = False,
) -> dict[str, Any]:
    """Steps 1-6 of the module docstring on one replica (``lora``: ``path`` is a LoRA adapter,
    loaded beside the base weights); its outcome (never raises)."""
    started = time.monotonic()
    client, rotation = replica.client, replica.rotation
    previous_lora = rotation.lora
    outcome: dict[str, Any] = {"url": replica.url, "version": rotation.weight_version}
    replica.loading = True
    hold = rotation.hold = asyncio.Event()
    try:
        try:
            await _post(client, "/pause?mode=abort")
        except RuntimeError as exc:
            rotation.failed_versions.add(version)
            outcome.update(ok=False, error=str(exc))
            return outcome
        loaded = False
        try:
            if lora:
                await _load_lora(replica, path, version)
            else:
                await _reload(replica, path)
                rotation.lora = None  # an adapter belongs to the base weights it was trained on
            await _post(client, "/reset_prefix_cache")
            await _post(client, "/update_weight_version", {"new_version": version})
            rotation.weight_version = version
            rotation.failed_versions.discard(version)
            loaded = True
            outcome.update(ok=True, version=version)
        except RuntimeError as exc:
            # Before the resume: what ran meanwhile ran on the weights it kept.
            rotation.failed_versions.add(version)
            outcome.update(ok=False, error=str(exc))
        finally:
            try:
                # Never left paused: its queued generations would wait forever.
                await _post(client, "/resume")
            except RuntimeError as exc:
                outcome.update(ok=False, error=f"{outcome.get('error', '')} {exc}".strip())
        outcome["reload_seconds"] = round(time.monotonic() - started, 3)
        if loaded and outcome["ok"]:
            await _verify(replicas, replica, probe, outcome)
            if lora:
                await _unload_lora(replica, previous_lora)
        return outcome
    finally:
        replica.loading = False
        rotation.hold = None
        hold.set()  # the held generations run here, or fail over where it is refused
        outcome["seconds"] = round(time.monotonic() - started, 3)


async def _verify(
    replicas: ReplicaSet, replica: Replica, probe: Probe | None, outcome: dict[str, Any]
) -> None:
    """Step 6's check and fingerprint; ``outcome`` says what was checked."""
    rotation = replica.rotation
    ids = probe.ids if probe is not None else replica.fingerprint_ids
    try:
        answers = await fingerprint(replicas, replica, ids)
    except (TimeoutError, Exception) as exc:  # noqa: BLE001 (any failure: not verified)
        why = f"its prompt logprobs for the probe did not come back ({exc or type(exc).__name__})"
        replica.unverified = rotation.refuse = why
        outcome.update(ok=False, checked=probe is not None, error=why)
        return
    if probe is None:
        replica.unverified = rotation.refuse = ""
        replica.probe_diff = None
        outcome["checked"] = False
        return
    diff = max_abs_diff(answers, probe.logprobs)
    replica.probe_diff = diff
    outcome.update(checked=True, max_diff=diff)
    if diff > replicas.tolerance:
        why = (
            f"after loading {rotation.weight_version!r} its logprobs for the probe are "
            f"{diff:.3g} from the trainer's (agenttap_weights_tolerance {replicas.tolerance:g}): "
            "it serves other weights than the trainer's (a folder that differs where it reads "
            "it, a partial load, an output layer a reload left stale)"
        )
        replica.unverified = rotation.refuse = why
        outcome.update(ok=False, error=why)
        logger.warning("agenttap: policy server %s is out of rotation: %s", replica.url, why)
        return
    replica.unverified = rotation.refuse = ""


class PolicyWeights:
    """One weight update at a time, on every replica of a pool."""

    def __init__(self) -> None:
        self.history = WeightHistory()
        self._lock = asyncio.Lock()

    async def update(
        self,
        http: aiohttp.ClientSession | None,
        replicas: ReplicaSet,
        path: Path,
        version: str,
        probe: Probe | None = None,
        lora: bool = False,
    ) -> list[dict[str, Any]]:
        """Every replica serves ``path`` (a LoRA adapter on the base weights with ``lora``) as
        ``version`` once this returns, checked against ``probe`` where given; each one's
        outcome. Raises WeightUpdateError if one failed to
        load or to pass the probe (it is out of rotation; the others serve the new weights).
        Each replica is reached through its own client's connection pool (a unix socket's
        server has its own); ``http``, the pool's shared session callers pass, is not
        needed."""
        async with self._lock:
            targets = list(replicas.replicas.values())
            if probe is not None:
                replicas.fingerprint_ids = list(probe.ids)
            for replica in targets:
                replica.rotation.incoming_version = version
            try:
                outcomes = await asyncio.gather(
                    *(load_on_replica(replicas, r, path, version, probe, lora) for r in targets)
                )
            finally:
                for replica in targets:
                    replica.rotation.incoming_version = None
            loaded = [o for o in outcomes if o.get("version") == version]
            if loaded:
                self.history.add(version)
            failed = [o for o in outcomes if not o["ok"]]
            if failed:
                raise WeightUpdateError(
                    f"{len(failed)} of {len(outcomes)} policy servers do not serve {path} "
                    f"as checked ({failed[0]['url']}: {failed[0]['error']}); "
                    f"{len(outcomes) - len(failed)} serve {version!r}",
                    list(outcomes),
                )
            logger.info(
                "agenttap: the policy serves weights %r from %s (%d server(s), %.2f s, %s)",
                version,
                path,
                len(outcomes),
                max((o["seconds"] for o in outcomes), default=0.0),
                "each checked against the trainer's probe"
                if probe is not None
                else "no probe given: not checked",
            )
            return list(outcomes)

    async def set_version(
        self,
        http: aiohttp.ClientSession | None,
        replicas: ReplicaSet,
        version: str,
        probe: Probe | None = None,
    ) -> list[dict[str, Any]]:
        """A trainer pushed weights to the servers itself (verl's own sync, NCCL): calls from
        now on are labelled ``version``. vLLM's own label is set too where it has the route
        (best effort; through each replica's client, as in ``update``). With ``probe`` each
        replica is checked as after an update (WeightUpdateError: one is past the
        tolerance, out of rotation); either way each is fingerprinted anew, so that the
        trainer's own push is not taken for weights nobody pushed."""
        async with self._lock:
            outcomes: list[dict[str, Any]] = []
            if probe is not None:
                replicas.fingerprint_ids = list(probe.ids)
            for replica in list(replicas.replicas.values()):
                replica.rotation.weight_version = version
                try:
                    await _post(replica.client, "/update_weight_version", {"new_version": version})
                    labelled = True
                except RuntimeError:
                    labelled = False
                outcome: dict[str, Any] = {
                    "url": replica.url,
                    "version": version,
                    "vllm_label": labelled,
                    "ok": True,
                }
                await _verify(replicas, replica, probe, outcome)
                outcomes.append(outcome)
            self.history.add(version)
            failed = [o for o in outcomes if not o["ok"]]
            if failed:
                raise WeightUpdateError(
                    f"{len(failed)} of {len(outcomes)} policy servers do not serve the "
                    f"trainer's weights {version!r} ({failed[0]['url']}: {failed[0]['error']})",
                    outcomes,
                )
            return outcomes
