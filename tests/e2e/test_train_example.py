"""examples/train_grpo.py as a user runs it (in .venv-train), one step: real Claude Code rollouts
from the real vLLM, a GRPO step, the weights saved and pushed, its line printed. The session's
vLLM gets its original weights back afterwards (``restored_policy``)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_trl_loop import TRAIN_PYTHON, restored_policy  # noqa: F401

pytestmark = pytest.mark.vllm


@pytest.mark.skipif(
    not TRAIN_PYTHON.exists(), reason="no .venv-train: run scripts/setup_train.sh to build it"
)
def test_one_step_of_the_example(restored_policy: str, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "run"
    done = subprocess.run(
        [str(TRAIN_PYTHON), str(REPO / "examples" / "train_grpo.py"), "--policy-url",
         restored_policy, "--steps", "1", "--n", "2", "--out", str(out)],
        cwd=tmp_path, env={**os.environ}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    line = re.search(r"step  1  reward (\S+) \((\d)/4 scored\).*grad_norm (\S+)", done.stdout)
    assert line, done.stdout[-3000:]
    assert line.group(2) == "4"  # every agent's rollout scored (a limit reached is no failure)
    assert "sampled by default -> pushed step-1" in done.stdout
    assert "reward by step: " in done.stdout
    assert (out / "weights" / "step-1" / "model.safetensors").exists()
    assert any((out / "shards" / "threads").glob("*.parquet"))
