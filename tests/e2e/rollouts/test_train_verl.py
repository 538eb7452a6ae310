"""verl's side on a CPU (issue 29): ``capture.train.verl.AgentTapAgentLoop``, instantiated the way
verl's ``AgentLoopWorker`` does it (Hydra, from ``capture/train/verl_agent_loop.yaml``), runs one
agenttap rollout of a python openai-SDK agent (two calls; answered by the scripted stub policy)
and returns an ``AgentLoopOutput``; verl's own ``_agent_loop_postprocess`` pads it and
``_postprocess`` batches it, as verl's ``*_on_cpu`` tests call them. Checked: the prompt cut to
``prompt_length`` keeping its end, left padding, right padding of the response, the response
mask (the user message between the calls 0), logprobs, attention mask, positions, the reward on
the last real response token, ``min_global_steps`` / ``max_global_steps``.

Runs in ``.venv-train`` (verl needs torch); skipped, with the reason, where verl could not be
installed (scripts/setup_train.sh leaves ``.venv-train/.verl-unavailable`` saying why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capture.client.launcher import AgentTap
from tests.e2e.rollouts.test_train_example import tensorboard_scalars
from tests.e2e.rollouts.test_train_trl_loop import SDK_AGENT, TRAIN_PYTHON
from tests.support.paths import QWEN3, REPO
from tests.support.stub_vllm import StubPolicy

UNAVAILABLE = REPO / ".venv-train" / ".verl-unavailable"

# Run by .venv-train's python with one JSON argument; prints one JSON line of what it saw.
VERL_SIDE = """
import asyncio, json, os, sys

import numpy as np

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopWorker, DictConfigWrap, ToolListWrap, _agent_loop_registry,
)

cfg = json.loads(sys.argv[1])
entry = OmegaConf.load(cfg["yaml"])[0]
pool = None
if cfg.get("pool_policy"):  # the driver's named Ray pool of proxies; the loop reaches it by name
    import ray
    from capture.client.ray_pool import ProxyPool

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = ProxyPool.start(cfg["pool_policy"], cfg["tokenizer"], cfg["pool_out"], num_proxies=2,
                           num_cpus=0.25, name="verl-pool")
    entry = OmegaConf.merge(entry, {"pool": "verl-pool"})
tokenizer = AutoTokenizer.from_pretrained(cfg["tokenizer"])
rollout = OmegaConf.create({"prompt_length": cfg["prompt_length"], "response_length": 64})
config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}})
loop = instantiate(
    config=entry, trainer_config=DictConfigWrap(config), server_manager=None,
    tokenizer=tokenizer, processor=None, hf_model_type="qwen3", dataset_cls=None,
    data_config=DictConfigWrap(OmegaConf.create({})), tools=ToolListWrap([]),
    agent={"command": [cfg["sdk_python"], "-c", cfg["sdk_agent"]]},
)
import capture.train.verl  # registered by its import (Hydra imported it)
assert _agent_loop_registry["agenttap"]["_target_"] == "capture.train.verl.AgentTapAgentLoop"


class Worker:  # the parts of AgentLoopWorker its post-processing reads
    tokenizer, processor, reward_loop_worker_handles = tokenizer, None, None
    rollout_config, distillation_enabled, mm_processor_kwargs = rollout, False, {}
    _compute_multi_modal_inputs = AgentLoopWorker._compute_multi_modal_inputs
    _compute_position_ids = AgentLoopWorker._compute_position_ids
    _compute_score = AgentLoopWorker._compute_score
    _compute_teacher_logprobs = AgentLoopWorker._compute_teacher_logprobs
    _get_mm_processor_kwargs = AgentLoopWorker._get_mm_processor_kwargs
    _pad_token_ids = AgentLoopWorker._pad_token_ids


raw_prompt = [{"role": "user", "content": cfg["task"]}]
own = {"limits": {"max_calls": 2}, "verifier": ["sh", "-c", "echo 0.5"]}  # this task's own
sample = {"raw_prompt": raw_prompt, "extra_info": {"agenttap": own}}


async def main():
    output = await loop.run({"temperature": 1.0}, **sample)
    worker = Worker()
    padded = await AgentLoopWorker._agent_loop_postprocess(worker, output, False, **sample)
    # Two samples of one prompt (verl's uid), as a GRPO group of two.
    uid = {"uid": np.array(["prompt-0", "prompt-0"], dtype=object)}
    batch = AgentLoopWorker._postprocess(worker, [padded, padded], uid)
    return output, padded, batch


output, padded, batch = asyncio.run(main())
logged = {}
if cfg.get("tensorboard"):  # the step's metrics as verl's trainer logs them, through its tracking
    from capture.train.verl import AgentTapLoopManager
    from verl.trainer.ppo.metric_utils import compute_timing_metrics
    from verl.utils.tracking import Tracking

    manager = AgentTapLoopManager.__new__(AgentTapLoopManager)  # what the trainer made it with
    timing = manager._performance_metrics([batch.meta_info["metrics"]], batch)
    logged = compute_timing_metrics(batch, timing)
    os.environ["TENSORBOARD_DIR"] = cfg["tensorboard"]
    tracking = Tracking("agenttap-test", "verl", default_backend=["tensorboard"])
    tracking.log(data=logged, step=1)
    tracking.finish()
if pool is not None:
    pool.shutdown(timeout=60)
print(json.dumps({
    "output": output.model_dump(exclude={"metrics"}),
    "prompts": padded.prompt_ids[0].tolist(),
    "responses": padded.response_ids[0].tolist(),
    "response_mask": padded.response_mask[0].tolist(),
    "attention_mask": padded.attention_mask[0].tolist(),
    "position_ids": padded.position_ids[0].tolist(),
    "logprobs": padded.response_logprobs[0].tolist(),
    "rm_scores": batch.batch["rm_scores"][0].tolist(),
    "min_global_steps": batch.non_tensor_batch["min_global_steps"].tolist(),
    "max_global_steps": batch.non_tensor_batch["max_global_steps"].tolist(),
    "pad_id": tokenizer.pad_token_id,
    "logged": {k: float(v) for k, v in logged.items() if "agenttap" in k or "agent_loop" in k},
}))
"""


def verl_unavailable() -> str | None:
    if not TRAIN_PYTHON.exists():
        return "no .venv-train: run scripts/setup_train.sh to build it"
    if UNAVAILABLE.exists():
        return f"verl is not installed in .venv-train: {UNAVAILABLE.read_text().strip()}"
    return None


@pytest.mark.skipif(verl_unavailable() is not None, reason=verl_unavailable() or "")
def test_the_agent_loop_runs_its_sample_on_a_named_ray_pool(
    stub: StubPolicy, tmp_path: Path
) -> None:
    """``pool: NAME`` in the loop's entry: the sample's rollout runs through the Ray pool the
    driver started under that name (``ProxyPool.attach``), on one of its two actors."""
    config = {
        "yaml": str(REPO / "capture" / "train" / "verl_agent_loop.yaml"),
        "tokenizer": str(QWEN3), "prompt_length": 64, "sdk_python": sys.executable,
        "sdk_agent": SDK_AGENT, "task": "Say OK twice.", "pool_policy": stub.url,
        "pool_out": str(tmp_path / "pool"),
    }  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTTAP_", "RAY_"))}
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", VERL_SIDE, json.dumps(config)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])["output"]
    extra = out["extra_fields"]
    assert extra["agenttap_proxy"] in (0, 1) and extra["agenttap_node"]
    assert out["num_turns"] == 4 and out["reward_score"] == 0.5
    session = extra["agenttap_session_id"]
    shards = list((tmp_path / "pool" / f"proxy-{extra['agenttap_proxy']}" / "threads").glob("*"))
    assert shards, f"no thread shard of {session} in its actor's folder"


@pytest.mark.skipif(verl_unavailable() is not None, reason=verl_unavailable() or "")
def test_the_agent_loop_output_through_verls_own_post_processing(
    stub_tap: AgentTap, tmp_path: Path
) -> None:
    prompt_length = 8  # shorter than the agent's first prompt: the cut is seen
    config = {
        "yaml": str(REPO / "capture" / "train" / "verl_agent_loop.yaml"),
        "tokenizer": str(QWEN3), "prompt_length": prompt_length, "sdk_python": sys.executable,
        "sdk_agent": SDK_AGENT, "task": "Say OK twice.",
        "tensorboard": str(tmp_path / "tensorboard"),
    }  # fmt: skip
    # The loop finds agenttap from the workers' environment, as the YAML's comment says.
    env = {**os.environ, "AGENTTAP_API": stub_tap.api_url, "AGENTTAP_TOKEN": stub_tap.token}
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", VERL_SIDE, json.dumps(config)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    out = seen["output"]
    extra = out["extra_fields"]

    # The agent's row: cut to prompt_length keeping its end; two calls in the response, the
    # user message between them masked; the sampler's logprobs on the sampled tokens.
    assert len(out["prompt_ids"]) == prompt_length and extra["prompt_tokens_cut"] > 0
    mask = out["response_mask"]
    assert mask[0] == 1 and 0 in mask and mask[-1] == 1, mask
    assert out["num_turns"] == 4 and out["reward_score"] == 0.5  # the sample's own verifier
    assert all(lp < 0 for lp, m in zip(out["response_logprobs"], mask, strict=True) if m)

    # verl's padding: the prompt on the left, the response on the right, masks to match.
    n = len(out["response_ids"])
    assert seen["prompts"] == out["prompt_ids"]  # exactly prompt_length: no padding needed
    assert seen["responses"][:n] == out["response_ids"]
    assert set(seen["responses"][n:]) == {seen["pad_id"]}
    assert seen["response_mask"][:n] == mask and set(seen["response_mask"][n:]) == {0}
    assert seen["attention_mask"] == [1] * (prompt_length + n) + [0] * (64 - n)
    assert seen["position_ids"][: prompt_length + n] == list(range(prompt_length + n))
    assert seen["logprobs"][:n] == pytest.approx(out["response_logprobs"], abs=1e-6)
    assert set(seen["logprobs"][n:]) == {0.0}
    # The reward on the last real response token, as verl puts it.
    assert seen["rm_scores"][n - 1] == 0.5 and sum(seen["rm_scores"]) == 0.5
    assert seen["min_global_steps"] == [None, None]  # the stub's rows name no numbered version
    assert extra["agenttap_session_id"]

    # The step's agenttap numbers (capture/train/metrics.py, the TRL adapter's names), logged by
    # verl's own tracking from AgentTapLoopManager's report, read back from TensorBoard's file.
    logged = seen["logged"]
    prefix = "timing_s/agenttap/"
    assert logged[prefix + "reward_mean"] == 0.5 and logged[prefix + "agents"] == 2
    assert logged[prefix + "scored"] == 2 and logged[prefix + "status_ok"] == 2
    # One group (the uid): a spread of 0, not NaN (each sample alone would have none).
    assert logged[prefix + "reward_std_in_group"] == 0.0
    assert logged[prefix + "calls_per_agent"] == 2
    assert logged[prefix + "completion_tokens_per_agent"] > 0
    assert (
        logged[prefix + "rollout_s"] > 0 and "timing_s/agent_loop/generate_sequences/max" in logged
    )
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    for name, value in logged.items():
        assert scalars[name] == [pytest.approx(value)], name
