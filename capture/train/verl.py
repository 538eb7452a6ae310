"""verl: agenttap rollouts as an agent loop, registered as ``agenttap``.

    # verl's config (Hydra overrides):
    actor_rollout_ref.rollout.agent.agent_loop_config_path=capture/train/verl_agent_loop.yaml
    actor_rollout_ref.rollout.agent.default_agent_loop=agenttap   # or an agent_name column

Each sample runs one agenttap rollout (``POST /rollouts``, n=1) of a CLI agent on the sample's
task: the text of the last user message of its ``raw_prompt``. The agent's main row comes back
as the ``AgentLoopOutput`` (``capture.train.rows.verl_fields``): ``prompt_ids`` (the first
call's prompt), ``response_ids`` (everything after it: sampled tokens and, between calls, tool /
environment tokens), ``response_mask`` (1 sampled, 0 tool), ``response_logprobs`` (the
sampler's), ``reward_score`` (the verifier's; None where it has none: verl's own reward function
then scores the sample), ``num_turns``, and ``extra_fields`` ``min_global_steps`` /
``max_global_steps`` (the numbers in the labels of the weights that sampled the trained tokens:
label your weights with verl's global step, ``tap.update_weights(DIR, str(global_steps))`` or
``tap.set_weight_version(...)``; give either ``model=`` and ``tokenizer=`` (the actor's module on
the driver's rank, ``capture.train.probe.weights_probe``: the weights' own forward, outside any
autocast or DDP wrapper the trainer put around it) and every policy server is checked against
the trainer's own logprobs after the sync, see docs/API.md).

**Truncation.** verl pads to ``rollout.prompt_length`` / ``response_length`` but never cuts;
this loop cuts by verl's own rule: a longer prompt keeps its last ``prompt_length`` tokens
(``AgentLoopBase._cap_text_prompt_length``), a longer response its first ``response_length``
(mask and logprobs with it). ``extra_fields`` say how many tokens each side lost.

**Where agenttap is.** The loop talks to a running agenttap instance (``AgentTap.start`` in the
trainer's driver, its policy URL pointing at the rollout servers verl started, or any instance):
``api_url`` and ``token`` / ``token_file`` from the YAML entry, else the environment variables
``AGENTTAP_API`` and ``AGENTTAP_TOKEN`` (set them before Ray starts its workers). Per sample,
``extra_info["agenttap"]`` may set ``agent``, ``workdir``, ``image``, ``task`` (a Harbor task
folder), ``verifier``, ``limits``, ``timeout_s`` (a task's own folder, image and verifier); the
YAML entry sets the defaults. Or ``pool: NAME``: a Ray pool of proxies the driver started with
``ProxyPool.start(..., name=NAME)`` in the same Ray job (``capture/client/ray_pool.py``): each
sample's agent runs on the node the pool places it on, its folders shipped there, and
``extra_fields`` name its ``agenttap_node`` and ``agenttap_proxy``.

**Metrics.** ``AgentTapLoopManager`` (below) adds each step's rollout numbers to what verl
logs, the TRL adapter's names (``capture/train/metrics.py``), as ``timing_s/agenttap/...``.

verl's ``sampling_params`` are not applied: the agent's own requests set temperature and length.
A rollout that made no row returns a one-token stand-in, masked (``response_mask`` 0), reward
None. This module imports verl (``.venv-train`` has it when ``scripts/setup_train.sh`` could
install it); the conversion itself, ``capture.train.rows``, needs nothing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopManager,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from capture.client.launcher import AgentTapError, ControlClient
from capture.train.metrics import RUN_SUMMARY_FIELD, batch_rollout_metrics
from capture.train.rows import DEFAULT_FILLER_ID, prompt_text, verl_fields

# How long a rollout refused for the proxy's cap on agents at once (429) waits to try again.
BUSY_RETRY_S = 2.0
PER_SAMPLE_KEYS = ("agent", "workdir", "verifier", "limits", "timeout_s", "image", "task")


def _plain(value: Any) -> Any:
    """A Hydra / OmegaConf value as plain JSON-able Python (dicts, lists, scalars)."""
    if isinstance(value, Mapping) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    if hasattr(value, "item"):  # numpy scalars from verl's non_tensor_batch
        return value.item()
    return value


def control_client(
    api_url: str | None = None, token: str | None = None, token_file: str | None = None
) -> ControlClient:
    """A client of the agenttap control API: the arguments, else ``AGENTTAP_API`` /
    ``AGENTTAP_TOKEN``; a clear error when either is missing."""
    url = api_url or os.environ.get("AGENTTAP_API")
    secret = token or (
        Path(token_file).read_text().strip() if token_file else os.environ.get("AGENTTAP_TOKEN")
    )
    if not url or not secret:
        raise AgentTapError(
            "the agenttap agent loop needs agenttap's control API: set api_url and token (or "
            "token_file) in its agent_loop_config_path entry, or AGENTTAP_API and AGENTTAP_TOKEN "
            "in the environment of verl's workers (AgentTap.start's api_url and token)"
        )
    return ControlClient(url, secret)


# Pools reached by name in this worker process, one handle each (ProxyPool.attach).
_POOLS: dict[str, Any] = {}


def attached_pool(name: str) -> Any:
    """The Ray proxy pool named ``name`` (``ProxyPool.attach``), once per process."""
    if name not in _POOLS:
        from capture.client.ray_pool import ProxyPool

        _POOLS[name] = ProxyPool.attach(str(name))
    return _POOLS[name]


@register("agenttap")
class AgentTapAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """One agenttap rollout per sample; see the module's docstring."""

    def __init__(
        self,
        *args: Any,
        api_url: str | None = None,
        token: str | None = None,
        token_file: str | None = None,
        agent: Any = "claude-code",
        workdir: str | None = None,
        verifier: Any = None,
        limits: Any = None,
        timeout_s: float | None = None,
        image: str | None = None,
        task: str | None = None,
        pool: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.pool = attached_pool(pool) if pool else None
        self.client = None if self.pool is not None else control_client(api_url, token, token_file)
        self.defaults = {
            "agent": _plain(agent),
            "workdir": workdir,
            "verifier": _plain(verifier),
            "limits": _plain(limits),
            "timeout_s": timeout_s,
            "image": image,
            "task": task,
        }

    def rollout_body(self, **kwargs: Any) -> dict[str, Any]:
        """The ``POST /rollouts`` body for one sample (its dataset fields as ``kwargs``)."""
        extra_info = _plain(kwargs.get("extra_info") or {})
        own = extra_info.get("agenttap") or {} if isinstance(extra_info, dict) else {}
        options = {**self.defaults, **{k: own[k] for k in PER_SAMPLE_KEYS if k in own}}
        body: dict[str, Any] = {
            "agent": options["agent"],
            "prompt": prompt_text(_plain(kwargs["raw_prompt"])),
            "n": 1,
            "wait": True,
            "metadata": {"split": "train", "trainer": "verl"},
        }
        if kwargs.get("uid") is not None:
            body["metadata"]["verl_uid"] = str(_plain(kwargs["uid"]))
        if options["workdir"] is not None:
            body["workdir"] = str(Path(options["workdir"]).resolve())
        verifier = options["verifier"]
        if verifier:
            body["verifier"] = {"command": verifier} if isinstance(verifier, list) else verifier
        for key in ("limits", "timeout_s", "image"):
            if options[key] is not None:
                body[key] = options[key]
        if options["task"] is not None:  # a Harbor task folder (docs/API.md)
            body["task"] = str(Path(options["task"]).resolve())
        return body

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        body = self.rollout_body(**kwargs)
        while True:
            try:
                if self.pool is not None:
                    answer = await self.pool.rollout_async(**body)
                    break
                assert self.client is not None
                answer, _ = await asyncio.to_thread(
                    self.client.request, "POST", "/rollouts", body, False, None
                )
                break
            except AgentTapError as exc:
                if exc.status != 429:  # not "too many agents at once": the caller's to see
                    raise
                await asyncio.sleep(BUSY_RETRY_S)
        run = (answer.get("rollouts") or [{}])[0]
        filler_id = self.tokenizer.pad_token_id
        fields = verl_fields(
            run,
            int(self.rollout_config.prompt_length),
            int(self.rollout_config.response_length),
            filler_id if isinstance(filler_id, int) else DEFAULT_FILLER_ID,
        )
        wall = float((run.get("metrics") or {}).get("rollout_wall_time_s") or 0.0)
        return AgentLoopOutput(**fields, metrics=AgentLoopMetrics(generate_sequences=wall))


class AgentTapLoopManager(AgentLoopManager):
    """verl's ``AgentLoopManager`` that adds each step's agenttap rollout numbers
    (``capture.train.metrics``: the names the TRL adapter logs) to what the manager reports.

        actor_rollout_ref.rollout.agent.agent_loop_manager_class=capture.train.verl.AgentTapLoopManager

    verl's trainer merges the manager's report into the step's ``timing_raw`` and logs it through
    its own tracking (``trainer.logger``: console, TensorBoard, W&B, ...) beside the actor's loss,
    KL and grad norm, so each number appears as ``timing_s/agenttap/NAME``
    (``timing_s/agenttap/reward_mean``, ``.../reward_std_in_group``, ...). Groups are verl's
    ``uid`` (the samples of one prompt); samples other agent loops made are left out."""

    def _performance_metrics(
        self, metrics: list[list[dict[str, str]]], output: Any
    ) -> dict[str, float]:
        # verl 0.9's one place where the manager's own numbers join the step's logged metrics.
        timing: dict[str, float] = super()._performance_metrics(metrics, output)
        batch = output.non_tensor_batch
        summaries = batch.get(RUN_SUMMARY_FIELD)
        if summaries is not None:
            uids = batch.get("uid")
            timing.update(
                batch_rollout_metrics(list(summaries), list(uids) if uids is not None else None)
            )
        return timing
