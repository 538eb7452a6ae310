"""The probe a trainer sends with its weights (``capture.train.probe.weights_probe``) is the
weights' own forward, also inside TRL's training step: there accelerate runs the model's forward
in bf16 autocast (``GRPOConfig``'s default), which put the example's in-memory probe ~0.05 from
the saved folder's logprobs (issue 38 item 2), and the model is in train mode, with dropout.

A real ``GRPOTrainer`` step in the trainer's environment (tests/support/probe_under_trl.py, .venv-train);
the saved folder loaded afresh stands for what a policy server loads."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.paths import REPO

TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
# What agenttap_weights_tolerance allows in fp32; the probe must be far inside it.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def under_trl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    if not TRAIN_PYTHON.exists():
        pytest.fail(f"{TRAIN_PYTHON} is missing: scripts/setup_train.sh builds it")
    folder = tmp_path_factory.mktemp("probe-under-trl")
    done = subprocess.run(
        [str(TRAIN_PYTHON), "tests/support/probe_under_trl.py", str(folder)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    print(found)
    return found


def test_the_probe_is_the_saved_weights_forward_inside_a_trl_step(
    under_trl: dict[str, object],
) -> None:
    # The conditions that moved it: TRL's bf16 autocast around the forward, train mode, dropout.
    assert under_trl["bf16"] is True and under_trl["autocast_wrapped"] is True
    assert under_trl["mode_before"] is True
    assert float(under_trl["wrapped_vs_saved"]) > TOLERANCE  # type: ignore[arg-type]
    assert float(under_trl["train_mode_vs_saved"]) > TOLERANCE  # type: ignore[arg-type]
    # The probe leaves them out: the saved folder's forward, to float rounding.
    assert float(under_trl["probe_vs_saved"]) < 1e-5  # type: ignore[arg-type]


def test_the_probe_leaves_the_model_in_train_mode(under_trl: dict[str, object]) -> None:
    assert under_trl["mode_after"] is True
