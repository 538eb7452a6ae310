"""The real loop on a CPU (issue 29): agenttap rollouts of a python openai-SDK agent and of real
Claude Code, answered by the real vLLM (fp32 tiny Qwen3) → capture.train.trl's rollout
function → 2 TRL ``GRPOTrainer`` optimizer steps (non-zero grad norm), each followed by
``save_pretrained`` and ``tap.update_weights`` → new rollouts. ``check_logprobs`` then shows the
rows agree with the trainer's own forward: the tokens each weight version sampled score within
1e-3 under that version's weights, and the last rollouts' tokens (labelled ``step-2``) do not
under the original weights (the update happened).

The trainer runs in ``.venv-train`` (scripts/setup_train.sh), as a subprocess: the proxy's
``.venv`` has no torch. The session's vLLM is shared by every real-vLLM test, and this test
loads trained weights into it: ``restored_policy`` pushes the original weights back, labelled
as they were, however the test ends (cheaper than a vLLM of its own: a minute and 3 GB).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.client.launcher import AgentTap
from capture.viewer import data as viewer
from capture.viewer.data import ShardSource
from policy_server import launcher as policy_server
from rewriter.vllm_client import DEFAULT_WEIGHT_VERSION
from tests.support.paths import QWEN3, REPO

# It changes the session's vLLM for everyone: no other test may use it meanwhile.
pytestmark = [pytest.mark.vllm, pytest.mark.policy_exclusive]

TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
TOLERANCE = 1e-3

# A python agent on the openai SDK, configured by the session's environment only (proxy, CA,
# its key): two calls, the second continuing the first's conversation, so its row is
# multi-turn (the user message between the calls is environment tokens, env_mask 0).
SDK_AGENT = """
import sys
from openai import OpenAI

client = OpenAI(max_retries=0, timeout=120)
messages = [{"role": "user", "content": sys.argv[1]}]
for _ in range(2):
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=12)
    text = reply.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
print(text)
"""

# The trainer side, run by .venv-train's python with one JSON argument (see test below).
TRAINER = """
import json, sys, time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from capture.client.launcher import AgentTap
from capture.rollouts.agents import AGENTS, resolve
from capture.train.rows import main_row, sampled_ids
from capture.train.trl import agenttap_reward, make_rollout_func
from capture.train.trl_cpu import cpu_friendly

cfg = json.loads(sys.argv[1])
out = Path(cfg["out"])
SDK_TASK, CLAUDE_TASK = "Write one short sentence.", "Answer in CAPITALS: name a colour."
env = {**AGENTS["claude-code"].env, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "24"}
claude = {"command": ["env", *(f"{k}={v}" for k, v in env.items()), resolve("claude"), "-p"]}
sdk = {"command": [cfg["sdk_python"], "-c", cfg["sdk_agent"]]}
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])


def shouting(task, run):
    row = main_row(run.get("rows") or [])
    text = tokenizer.decode(sampled_ids(row), skip_special_tokens=True) if row else ""
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


result = {"steps": [], "push_s": [], "sessions": {}, "advantages": {}}
with AgentTap.start(cfg["policy_url"], cfg["model"], out / "shards", confdir=cfg["confdir"]) as tap:
    rollouts = make_rollout_func(
        tap, agent=lambda task: sdk if task == SDK_TASK else claude, verifier=shouting,
        limits={"max_calls": 2},
    )

    class Push(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            version = f"step-{state.global_step}"
            result["sessions"][version] = rollouts.last.sessions
            # What TRL trained this step's samples with (scale_rewards="group"), in their order.
            result["advantages"][version] = list(trainer._logs["advantages"])
            folder = out / "weights" / version
            model.save_pretrained(folder)
            started = time.monotonic()
            tap.update_weights(folder, version)
            result["push_s"].append(time.monotonic() - started)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                result["steps"].append({k: logs.get(k) for k in ("loss", "grad_norm", "reward")})

    model = cpu_friendly(AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32))
    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, use_vllm=False, max_steps=2,
        per_device_train_batch_size=4, num_generations=2, learning_rate=0.01,
        lr_scheduler_type="constant", beta=0.0, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, scale_rewards="group",
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[agenttap_reward], args=config,
        train_dataset=Dataset.from_dict({"prompt": [SDK_TASK, CLAUDE_TASK]}),
        rollout_func=rollouts, callbacks=[Push()],
    )
    trainer.train()
    after = rollouts([SDK_TASK, SDK_TASK, CLAUDE_TASK, CLAUDE_TASK], None)
    result["after"] = {
        "sessions": after["agenttap_session_id"],
        "versions": after["agenttap_weight_versions"],
        "env_mask": after["env_mask"],
        "completion_ids": after["completion_ids"],
    }
Path(cfg["result"]).write_text(json.dumps(result))
"""


@pytest.fixture
def restored_policy(vllm_url: str, confdir: Path, tmp_path: Path) -> Iterator[str]:
    """The session's vLLM, given its original weights back (and their label) after the test."""
    yield vllm_url
    model = policy_server.ensure_tiny_model(tokenizer=QWEN3)
    with AgentTap.start(vllm_url, QWEN3, tmp_path / "restore", confdir=confdir) as tap:
        tap.update_weights(model, DEFAULT_WEIGHT_VERSION)


def check_logprobs(out: Path, model: Path, version: str) -> tuple[int, float, str]:
    """``python -m capture.train.check_logprobs`` in .venv-train: its exit code, max |diff|,
    and its output (printed, for the test's log)."""
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-m", "capture.train.check_logprobs", str(out),
         "--model", str(model), "--version", version, "--tolerance", str(TOLERANCE)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    text = done.stdout + done.stderr
    print(f"check_logprobs --version {version} --model {model.name}:\n{text}")
    found = re.search(r"max \|diff\|: (\S+)", text)
    assert found, text
    return done.returncode, float(found.group(1)), text


@pytest.mark.skipif(
    not TRAIN_PYTHON.exists(), reason="no .venv-train: run scripts/setup_train.sh to build it"
)
def test_grpo_steps_push_weights_that_the_next_rollouts_sample_from(
    restored_policy: str, confdir: Path, tmp_path: Path
) -> None:
    model = policy_server.ensure_tiny_model(tokenizer=QWEN3)
    out = tmp_path / "run"
    config = {
        "policy_url": restored_policy, "model": str(model), "out": str(out),
        "confdir": str(confdir), "sdk_python": sys.executable, "sdk_agent": SDK_AGENT,
        "result": str(tmp_path / "result.json"),
    }  # fmt: skip
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", TRAINER, json.dumps(config)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    print("steps:", result["steps"], "seconds per update:", result["push_s"])

    # Two optimizer steps that moved the weights, each pushed to the policy.
    assert len(result["steps"]) == 2
    assert all(step["grad_norm"] > 0 for step in result["steps"]), result["steps"]
    assert len(result["push_s"]) == 2

    # The new rollouts were sampled by the last weights pushed, and say so; the SDK agent's
    # rows are multi-turn: environment tokens between its calls are masked.
    after = result["after"]
    assert after["versions"] == [["step-2"]] * 4, after["versions"]
    sdk_masks = after["env_mask"][:2]
    assert all(0 in mask[mask.index(1) :] for mask in sdk_masks), sdk_masks

    shards = out / "shards"
    weights = out / "weights"
    # The viewer's advantages are the ones TRL trained with (scaled by each group's spread),
    # sent by the rollout function: each step's, for every sample.
    source = ShardSource(shards)
    sessions = viewer.session_list(source.summaries())
    shown = {
        r["id"]: (r["advantage"], r["advantage_source"])
        for gid in {viewer.session_value(s, "group_id") for s in sessions} - {None}
        for r in viewer.group_view(sessions, [], str(gid), source.advantages())["rollouts"]
    }
    for version in ("step-1", "step-2"):
        trained = dict(zip(result["sessions"][version], result["advantages"][version], strict=True))
        assert len(trained) == 4 and any(abs(a) > 0.5 for a in trained.values()), trained
        for sid, advantage in trained.items():
            assert shown[sid] == (pytest.approx(advantage, abs=1e-6), "trainer"), (sid, shown)
    # Each version's tokens score within 1e-3 under that version's weights.
    for version, folder in (
        (DEFAULT_WEIGHT_VERSION, model),
        ("step-1", weights / "step-1"),
        ("step-2", weights / "step-2"),
    ):
        code, diff, text = check_logprobs(shards, folder, version)
        assert code == 0 and diff <= TOLERANCE, text
        assert "tokens compared: 0" not in text, text
    # ... and the last ones not under the original weights: the update really happened.
    code, diff, text = check_logprobs(shards, model, "step-2")
    assert code == 1 and diff > 10 * TOLERANCE, text
