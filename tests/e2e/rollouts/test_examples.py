"""examples/grpo_rollouts.py as a user runs it: real Claude Code rollouts against the scripted
stub, scored by the example's verifier, grouped GRPO-style into one saved batch."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.support.paths import QWEN3, REPO
from tests.support.stub_vllm import StubPolicy


def test_grpo_example_runs_scores_and_groups(stub: StubPolicy, tmp_path: Path) -> None:
    # Every other rollout writes the wrong text: rewards 1 and 0, so advantages are +-0.5.
    texts = itertools.cycle(["hi", "no"])

    def rule(body: dict[str, Any]) -> str | None:
        if "<tool_response>" in stub.tok.decode(body["prompt"]):
            return "Done."
        return hermes("Bash", {"command": f"printf {next(texts)} > hello.txt", "description": "w"})

    stub.rules.insert(0, rule)
    try:
        done = subprocess.run(
            # From another folder, with a relative --out: the same as from the checkout.
            [sys.executable, str(REPO / "examples" / "grpo_rollouts.py"), "--policy-url",
             stub.url, "--tokenizer", str(QWEN3), "--agent", "claude-code", "--n", "2",
             "--out", "run"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        stub.rules.remove(rule)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "run" / "batch.json").read_text())
    assert sorted(summary["rewards"]) == [0.0, 1.0]
    assert sorted(summary["advantages"]) == [-0.5, 0.5]
    assert len(set(summary["group_id"])) == 1  # one task: one group
    batch = np.load(tmp_path / "run" / "batch.npz")
    assert batch["advantages"].shape == (2,)
    assert batch["responses"].shape[0] == 2 and batch["response_mask"].sum() > 0
    assert (batch["input_ids"].shape[1]) == batch["prompts"].shape[1] + batch["responses"].shape[1]
