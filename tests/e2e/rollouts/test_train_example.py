"""examples/train_grpo.py as a user runs it (in .venv-train): real Claude Code rollouts from the
real vLLM, GRPO steps, the weights saved and pushed (each push checked against the trainer's
probe), a line per step. Then the same command again, with the same ``--seed`` and ``--out``:
the same rewards, losses and tokens (issue 40 item 5: vLLM's sampling is seeded per call, torch by
the seed). The session's vLLM gets its original weights back after each run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.client.launcher import AgentTap
from policy_server import launcher as policy_server
from rewriter.vllm_client import DEFAULT_WEIGHT_VERSION
from tests.e2e.rollouts.test_train_trl_loop import TRAIN_PYTHON
from tests.support.paths import QWEN3, REPO

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.policy_exclusive,  # pushes weights into the session's vLLM
    pytest.mark.skipif(
        not TRAIN_PYTHON.exists(), reason="no .venv-train: run scripts/setup_train.sh to build it"
    ),
]

SEED = 5
STEPS = 2  # the second step's rollouts are sampled by the first step's trained weights
# What the probe of each push may be off by (agenttap_weights_tolerance in fp32).
TOLERANCE = 1e-3


def run_example(
    policy_url: str, out: Path, confdir: Path, seed: int = SEED, steps: int = STEPS,
    extra: tuple[str, ...] = (),
) -> str:  # fmt: skip
    """One run of the example on ``policy_url``; its output. The policy gets its original
    weights back afterwards, so the next run starts where this one did."""
    try:
        done = subprocess.run(
            [str(TRAIN_PYTHON), str(REPO / "examples" / "train_grpo.py"), "--policy-url",
             policy_url, "--steps", str(steps), "--n", "2", "--seed", str(seed),
             "--out", str(out), *extra],
            cwd=out.parent, env={**os.environ}, capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
    finally:
        model = policy_server.ensure_tiny_model(tokenizer=QWEN3)
        with AgentTap.start(policy_url, QWEN3, out.parent / "restore", confdir=confdir) as tap:
            tap.update_weights(model, DEFAULT_WEIGHT_VERSION)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


@pytest.fixture(scope="module")
def first_run(
    vllm_url: str, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, str]]:
    out = tmp_path_factory.mktemp("train-example") / "run"
    yield out, run_example(vllm_url, out, confdir)


def stop_after_checkpoint(policy_url: str, out: Path, confdir: Path, step: int) -> str:
    """The example run with --overwrite and a checkpoint each step, sent SIGTERM once step
    ``step``'s checkpoint is whole (its trainer state, written last, reads as JSON); its output.
    The policy gets its original weights back afterwards."""
    state = out / "trainer" / f"checkpoint-{step}" / "trainer_state.json"
    proc = subprocess.Popen(
        [str(TRAIN_PYTHON), str(REPO / "examples" / "train_grpo.py"), "--policy-url", policy_url,
         "--steps", str(STEPS), "--n", "2", "--seed", str(SEED), "--out", str(out),
         "--overwrite", "--save-steps", "1"],
        cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                json.loads(state.read_text())
                break
            except (OSError, ValueError):
                time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it was to be stopped"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        model = policy_server.ensure_tiny_model(tokenizer=QWEN3)
        with AgentTap.start(policy_url, QWEN3, out.parent / "restore", confdir=confdir) as tap:
            tap.update_weights(model, DEFAULT_WEIGHT_VERSION)
    assert proc.returncode == 143, output[-3000:]
    assert f"step  {step + 1}  reward" not in output  # stopped before the next step's line
    return output


def what_repeats(stdout: str) -> list[str]:
    """The run's lines that a seed must repeat: each step's rewards (each rollout's, in full),
    loss, grad norm and tokens; not its times or the push's |diff|."""
    lines = re.findall(r"^step +\d+  rewards .*$", stdout, flags=re.M)
    lines += [
        re.sub(r"  rollout .*", "", line)
        for line in re.findall(r"^step +\d+  reward .*$", stdout, flags=re.M)
    ]
    lines += re.findall(r"^reward by step: .*$", stdout, flags=re.M)
    return lines


def test_steps_of_the_example(first_run: tuple[Path, str]) -> None:
    out, stdout = first_run
    print(stdout[-4000:])
    line = re.search(r"step  1  reward (\S+) \((\d)/4 scored\).*grad_norm (\S+)", stdout)
    assert line, stdout[-3000:]
    assert line.group(2) == "4"  # every agent's rollout scored (a limit reached is no failure)
    assert "sampled by default -> pushed step-1" in stdout
    assert "sampled by step-1 -> pushed step-2" in stdout
    # Every push was checked against the trainer's in-memory probe, and passed.
    pushes = re.findall(r"\(checked, max \|diff\| (\S+)\)$", stdout, flags=re.M)
    assert len(pushes) == STEPS, stdout[-3000:]
    assert all(float(diff) < TOLERANCE for diff in pushes), pushes
    assert "reward by step: " in stdout
    # A line per rollout group as it ends (a task's agents are one group: two tasks a step,
    # or one when the step drew the same task twice), into a pipe here.
    groups = re.findall(r"^  group (\d)/(\d) s\d+-step(\d)-\d: (\d)/(\d) ok", stdout, flags=re.M)
    for step in range(STEPS):
        mine = [g for g in groups if g[2] == str(step)]
        assert [int(g[0]) for g in mine] == list(range(1, int(mine[0][1]) + 1)), groups
        assert sum(int(g[4]) for g in mine) == 4, groups  # every agent of the step
    viewer = re.search(r"^live viewer: (http://\S+/ui/#token=\S+)$", stdout, flags=re.M)
    assert viewer, stdout[:3000]
    assert (out / "weights" / f"step-{STEPS}" / "model.safetensors").exists()
    assert any((out / "shards" / "threads").glob("*.parquet"))
    # The trainer's own logger (report_to tensorboard) holds agenttap's rollout numbers beside
    # TRL's loss and grad norm, one point per step (issue 51 item 3).
    scalars = tensorboard_scalars(out / "tensorboard")
    assert {"train/loss", "train/grad_norm"} <= set(scalars), sorted(scalars)
    for name in (
        "reward_mean",
        "reward_std_in_group",
        "scored",
        "calls_per_agent",
        "completion_tokens_per_agent",
        "weight_versions",
        "rollout_s",
        "push_max_diff",
    ):
        assert len(scalars.get(f"train/agenttap/{name}", [])) == STEPS, (name, sorted(scalars))
    assert scalars["train/agenttap/scored"] == [4.0] * STEPS
    assert max(scalars["train/agenttap/push_max_diff"]) < TOLERANCE
    step1 = float(line.group(1))
    assert scalars["train/agenttap/reward_mean"][0] == pytest.approx(step1, abs=1e-3)


def tensorboard_scalars(folder: Path) -> dict[str, list[float]]:
    """Every scalar series in the TensorBoard event files under ``folder``, read by
    TensorBoard's own reader (in the trainer's environment)."""
    read = (
        "import json, sys\n"
        "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
        "acc = EventAccumulator(sys.argv[1]); acc.Reload()\n"
        "print(json.dumps({t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}))"
    )
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", read, str(folder)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, list[float]] = json.loads(done.stdout)
    return found


def test_the_same_seed_gives_the_same_rewards(
    first_run: tuple[Path, str], vllm_url: str, confdir: Path
) -> None:
    out, stdout = first_run
    # A folder holding a run is replaced only when asked.
    refused = subprocess.run(
        [str(TRAIN_PYTHON), str(REPO / "examples" / "train_grpo.py"), "--policy-url", vllm_url,
         "--out", str(out)],
        cwd=out.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode != 0 and "give --overwrite to replace it" in refused.stderr
    assert (out / "weights" / f"step-{STEPS}" / "model.safetensors").exists()  # untouched
    # The repeat in another folder, deeper (issue 51 item 1: the agents see theirs at /workdir,
    # so the prompts, and so the samples, do not depend on where --out is), over a copy of the
    # first run, replaced with --overwrite; stopped (SIGTERM) once step 1's checkpoint is
    # saved, then resumed from it (item 2).
    elsewhere = out.parent / "another" / "folder" / "run"
    shutil.copytree(out, elsewhere)
    (elsewhere / "planted.txt").write_text("from the run replaced")
    stopped = stop_after_checkpoint(vllm_url, elsewhere, confdir, step=1)
    assert not (elsewhere / "planted.txt").exists()
    resumed = run_example(vllm_url, elsewhere, confdir, extra=("--resume", "--save-steps", "1"))
    assert "resuming from" in resumed and "pushed checkpoint-1 as step-1 (checked" in resumed
    again = stopped + resumed
    # Step 1 from the stopped run, step 2 from the resumed one: the same lines as one run.
    expected = what_repeats(stdout)
    assert len(expected) == 2 * STEPS + 1, stdout[-3000:]
    print("\n".join(expected))
    assert what_repeats(stopped) == [x for x in expected if re.match(r"step +1 ", x)], stopped
    again = re.sub(r"^reward by step: .*$", "", again, flags=re.M)
    again += "\nreward by step: " + " ".join(
        re.findall(r"^step +\d+  reward (\S+)", again, flags=re.M)
    )
    assert what_repeats(again) == expected, again[-3000:]


def test_the_example_trains_through_a_ray_pool_of_two_actors(
    vllm_url: str, confdir: Path, tmp_path: Path
) -> None:
    """``--ray-actors 2``: TRL's rollout function takes a ``ProxyPool`` where it takes a tap;
    each task's agents spread over the two proxy actors, the step's weights pushed through
    one actor (checked) and announced to the other."""
    out = tmp_path / "run"
    stdout = run_example(vllm_url, out, confdir, steps=1, extra=("--ray-actors", "2"))
    print(stdout[-3000:])
    line = re.search(r"step  1  reward (\S+) \((\d)/4 scored\)", stdout)
    assert line and line.group(2) == "4", stdout[-3000:]
    pushes = re.findall(r"\(checked, max \|diff\| (\S+)\)$", stdout, flags=re.M)
    assert len(pushes) == 1 and float(pushes[0]) < TOLERANCE, stdout[-3000:]
    # Both actors ran agents: each proxy folder holds thread shards of its sessions.
    for proxy in ("proxy-0", "proxy-1"):
        assert any((out / "shards" / proxy / "threads").glob("*.parquet")), proxy


def test_a_dead_policy_url_is_named_before_anything_is_written(tmp_path: Path) -> None:
    """``--policy-url`` where nothing answers: the flag to fix is named (not the proxy's
    ``--set agenttap_policy_url``), and ``--out`` is not touched."""
    done = subprocess.run(
        [str(TRAIN_PYTHON), str(REPO / "examples" / "train_grpo.py"), "--policy-url",
         "http://127.0.0.1:9", "--out", str(tmp_path / "run")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--policy-url http://127.0.0.1:9: no vLLM answers there" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
