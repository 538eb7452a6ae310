"""``python -m capture.train.check_logprobs`` over rows of two weight versions with each version's
real weights (issue 38 item 7): two tiny Qwen3 models built here (version 2 is version 1 after a
step), rows whose trained tokens carry their version's logprobs (a row spanning the update too),
and one row labelled version 2 that version 1's weights sampled: found, and only it.

The trainer's environment (.venv-train: torch, transformers) runs the tool, as a user does;
tests/support/two_versions.py builds the models and rows there."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"
TOLERANCE = 1e-3


def run(*args: str) -> subprocess.CompletedProcess[str]:
    if not TRAIN_PYTHON.exists():
        pytest.fail(f"{TRAIN_PYTHON} is missing: scripts/setup_train.sh builds it")
    return subprocess.run(
        [str(TRAIN_PYTHON), *args], capture_output=True, text=True, cwd=REPO, timeout=600
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("two-versions")
    done = run("tests/support/two_versions.py", str(folder))
    assert done.returncode == 0, done.stderr[-3000:]
    made = json.loads(done.stdout.strip().splitlines()[-1])
    assert "t-mixed" in made["threads"] and made["tokens"] == {"1": 18, "2": 24}
    return folder


def worst_rows(section: str) -> dict[str, float]:
    """The ``worst rows`` lines of one version's report: thread id -> max |diff|."""
    found = re.findall(r"^\s+(\S+)\s+session \S+ thread (\S+):", section, flags=re.M)
    return {thread: float(diff) for diff, thread in found}


def test_a_row_labelled_with_weights_that_did_not_sample_it_is_found(built: Path) -> None:
    done = run(
        "-m", "capture.train.check_logprobs", str(built / "out"),
        "--model", str(built / "models"), "--tolerance", str(TOLERANCE),
    )  # fmt: skip
    print(done.stdout, done.stderr)
    assert done.returncode == 1, done.stderr[-3000:]
    one, two = done.stdout.split("weight version '2'")
    assert f"weight version '1', weights {built / 'models' / '1'}:" in one
    # Version 1's tokens (a row spanning the update included) agree with version 1's weights.
    assert worst_rows(one).keys() == {"t-v1-0", "t-v1-1", "t-update"}
    assert max(worst_rows(one).values()) < TOLERANCE
    # Version 2's: all but the mislabelled row agree with version 2's weights.
    diffs = worst_rows(two)
    assert diffs.keys() == {"t-v2-0", "t-v2-1", "t-update", "t-mixed"}
    assert diffs["t-mixed"] > 0.1
    assert max(d for t, d in diffs.items() if t != "t-mixed") < TOLERANCE
    (fail,) = [line for line in done.stderr.splitlines() if line.startswith("FAIL")]
    assert fail.startswith("FAIL: weight version '2'") and "thread t-mixed" in fail


def test_the_rows_each_version_sampled_pass_under_their_own_weights(built: Path) -> None:
    models = built / "models"
    done = run(
        "-m", "capture.train.check_logprobs", str(built / "out"),
        "--models", f"1={models / '1'},2={models / '2'}", "--session", "s-t-update",
    )  # fmt: skip
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stderr
    assert done.stdout.count("tokens compared: 6") == 2, "each version's reply, by its weights"
