"""``python -m capture.train.check_logprobs``'s messages over rows of several weight versions
(issue 40): it names the versions present and suggests ``--version``. The model is a stand-in
here (the forward itself is checked with real weights in tests/e2e/rollouts/test_train_trl_loop.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capture.storage.reader import load_threads
from capture.train import check_logprobs
from tests.support.viewer_data import write_run


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three steps of one group of 5: versions v0, v1, v2 (and v3, where weights moved during
    step 2's last session). The model gives the rows' own logprobs to the tokens of
    ``agree`` (a version), 0.0 to every other."""
    write_run(tmp_path, steps=3, groups_per_step=1, n=5)
    rows = load_threads(tmp_path)
    monkeypatch.setattr(check_logprobs, "load_model", lambda _: None)

    def score(_: Any, input_ids: list[int], positions: list[int]) -> list[float]:
        row = next(r for r in rows if r["input_ids"] == list(input_ids))
        spans = [s for s in row["weight_versions"] if s["version"] == score.agree]  # type: ignore[attr-defined]
        return [
            float(row["logprobs"][p]) if any(s["start"] <= p < s["end"] for s in spans) else 0.0
            for p in positions
        ]

    score.agree = "v1"  # type: ignore[attr-defined]
    monkeypatch.setattr(check_logprobs, "score_positions", score)
    return tmp_path


def test_the_versions_present_are_counted_by_trained_token(out: Path) -> None:
    versions = check_logprobs.versions_present(load_threads(out))
    assert list(versions) == ["v0", "v1", "v2", "v3"]
    assert sum(versions.values()) == sum(sum(r["loss_mask"]) for r in load_threads(out))


def test_without_version_it_lists_the_versions_and_suggests_one(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check_logprobs.main([str(out), "--model", "m"]) == 1
    err = capsys.readouterr().err
    assert "note: these rows were sampled by 4 weight versions: v0 (" in err
    assert "check each with --version V" in err and "--version v0" in err
    assert "FAIL: max |diff|" in err and "pass --version V with the weights of version V" in err


def test_a_version_not_present_names_those_that_are(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check_logprobs.main([str(out), "--model", "m", "--version", "v9"]) == 2
    err = capsys.readouterr().err
    assert "sampled by weight version 'v9'" in err and "the rows name 4: v0 (" in err


def test_the_version_the_weights_sampled_passes_without_a_note(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check_logprobs.main([str(out), "--model", "m", "--version", "v1"]) == 0
    captured = capsys.readouterr()
    assert "note:" not in captured.err and "max |diff|: 0" in captured.out
