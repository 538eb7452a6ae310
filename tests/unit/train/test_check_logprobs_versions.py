"""``python -m capture.train.check_logprobs`` with the weights of each version (issue 38 item 7):
``--model DIR`` holding one folder per version, or ``--models VERSION=DIR,...``; each span is
checked against the weights its ``weight_versions`` names, so rows labelled with a version whose
weights did not sample them are found. The models here are stand-ins (a model is its version's
name; it gives a row's own logprob to the tokens of its version, and other weights' to the rest);
tests/unit/train/test_check_logprobs_models.py does the same with two real tiny models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from capture.storage.reader import load_threads
from capture.train import check_logprobs
from tests.support.viewer_data import write_run

# A session of step 1 (versions v1, v1): its rows say v1, but v0's weights sampled them.
MIXED = "t-grpo-01-0-2"


def versions_of(row: dict[str, Any], position: int) -> str | None:
    return next(
        (s["version"] for s in row["weight_versions"] if s["start"] <= position < s["end"]), None
    )


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three steps of one group of 5: versions v0..v3 (v3: weights moved during step 2's last
    session). A stand-in model is the name of its folder: it gives the logprob a row holds to
    the tokens that name its version, -1 more to every other; ``MIXED``'s tokens were sampled by
    v0 whatever they say."""
    write_run(tmp_path / "out", steps=3, groups_per_step=1, n=5)
    rows = load_threads(tmp_path / "out")
    monkeypatch.setattr(check_logprobs, "load_model", lambda folder: Path(folder).name)

    def score(model: str, input_ids: list[int], positions: list[int]) -> list[float]:
        row = next(r for r in rows if r["input_ids"] == list(input_ids))
        sampler = (lambda p: "v0") if row["thread_id"] == MIXED else (lambda p: versions_of(row, p))
        return [float(row["logprobs"][p]) - (sampler(p) != model) for p in positions]

    monkeypatch.setattr(check_logprobs, "score_positions", score)
    return tmp_path / "out"


def weights(tmp_path: Path, *versions: str) -> Path:
    """A folder holding one (stand-in) model folder per version."""
    root = tmp_path / "weights"
    for version in versions:
        (root / version).mkdir(parents=True)
        (root / version / "config.json").write_text("{}")
    return root


def test_a_folder_per_version_finds_the_rows_another_version_sampled(
    out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = weights(tmp_path, "v0", "v1", "v2", "v3", "unused")
    assert check_logprobs.main([str(out), "--model", str(root)]) == 1
    captured = capsys.readouterr()
    for version in ("v0", "v1", "v2", "v3"):
        assert f"weight version '{version}', weights {root / version}:" in captured.out
    assert "unused" not in captured.out
    (fail,) = [line for line in captured.err.splitlines() if line.startswith("FAIL")]
    assert fail.startswith("FAIL: weight version 'v1': max |diff| 1 > 0.001")
    assert f"thread {MIXED}" in fail and "a mixed policy" in fail
    # Every other row agrees with its own version's weights, a row spanning an update too.
    rows = [r for r in load_threads(out) if r["thread_id"] != MIXED]
    assert (
        check_logprobs.check_versions(rows, [(v, root / v) for v in ("v0", "v1", "v2", "v3")], 1e-3)
        == 0
    )


def test_models_maps_each_version_to_its_folder(
    out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = weights(tmp_path, "v0", "v1", "v2", "v3")
    given = ",".join(f"{v}={root / v}" for v in ("v0", "v1", "v2", "v3"))
    assert check_logprobs.main([str(out), "--models", given]) == 1
    assert f"thread {MIXED}" in capsys.readouterr().err
    # The mixed session's rows alone, and one version alone.
    session = MIXED.removeprefix("t-")
    assert check_logprobs.main([str(out), "--models", given, "--session", session]) == 1
    assert check_logprobs.main([str(out), "--models", given, "--version", "v2"]) == 0
    assert check_logprobs.main([str(out), "--model", str(root), "--version", "v3"]) == 0
    # v0's weights really sampled it: mapping v1 to them passes it.
    remapped = given.replace(f"v1={root / 'v1'}", f"v1={root / 'v0'}")
    assert check_logprobs.main([str(out), "--models", remapped, "--session", session]) == 0


def test_a_version_without_weights_is_named_with_the_folders_there(
    out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = weights(tmp_path, "v0", "v1")
    assert check_logprobs.main([str(out), "--model", str(root)]) == 2
    err = capsys.readouterr().err
    assert "no weights for weight versions v2 (" in err and "v3 (" in err
    assert f"--model {root} (its folders: v0, v1)" in err
    assert "the rows name v0 (" in err and "--version V" in err and "--models" in err
    given = f"v0={root / 'v0'},v1={root / 'v1'}"
    assert check_logprobs.main([str(out), "--models", given]) == 2
    assert "no weights for weight versions v2" in capsys.readouterr().err
    # One version, whose folder is there: checked alone.
    assert check_logprobs.main([str(out), "--model", str(root), "--version", "v0"]) == 0


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "give the weights that sampled the rows: --model DIR"),
        (["--model", "m", "--models", "v0=m"], "give the weights that sampled the rows"),
        (["--models", "v0"], "--models takes VERSION=DIR pairs separated by commas"),
        (["--models", "v0=a,v0=b"], "names weight version 'v0' twice"),
        (["--models", ","], "--models is empty"),
    ],
)
def test_weights_given_wrong_are_refused_naming_the_form(
    out: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    assert check_logprobs.main([str(out), *args]) == 2
    assert said in capsys.readouterr().err


def test_a_folder_with_no_model_in_it_says_what_it_must_hold(
    out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert check_logprobs.main([str(out), "--model", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "holds no model (no config.json) and no folder of one per weight version" in err
    root = weights(tmp_path, "v0", "v1", "v2", "v3")
    (root / "v2" / "config.json").unlink()
    (root / "v2" / "model.safetensors").write_text("")
    given = ",".join(f"{v}={root / v}" for v in ("v0", "v1", "v2", "v3"))
    assert check_logprobs.main([str(out), "--models", given]) == 2
    assert f"{root / 'v2'} (weight version 'v2') holds no model" in capsys.readouterr().err


def test_rows_naming_no_version_need_the_one_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "out", steps=1, groups_per_step=1, n=2)
    rows = load_threads(tmp_path / "out")
    for row in rows:
        row["weight_versions"] = []
    monkeypatch.setattr(check_logprobs, "load_threads", lambda *a, **k: rows)
    root = weights(tmp_path, "v0")
    assert check_logprobs.main([str(tmp_path / "out"), "--model", str(root)]) == 2
    assert "the rows name no weight version" in capsys.readouterr().err
    # Given per version, tokens that name none are counted, not checked.
    rows[0]["weight_versions"] = [{"version": "v0", "start": 0, "end": len(rows[0]["input_ids"])}]
    monkeypatch.setattr(check_logprobs, "load_model", lambda folder: "v0")
    monkeypatch.setattr(check_logprobs, "score_positions", lambda m, ids, ps: [0.0] * len(ps))
    for row in rows:
        row["logprobs"] = [0.0] * len(row["input_ids"])
    assert check_logprobs.main([str(tmp_path / "out"), "--model", str(root)]) == 0
    trained = sum(rows[1]["loss_mask"])
    assert f"note: {trained} trained tokens name no weight version" in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["/no/such/weights", "./weights/step-9", "a/b/c"])
def test_a_model_folder_that_does_not_exist_is_named_not_fetched(
    out: Path, missing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path that does not exist is an error naming it, not a transformers traceback about a
    hub id (issue 51); ``namespace/name`` stays a model id from_pretrained may fetch."""
    assert check_logprobs.main([str(out), "--model", missing]) == 2
    assert f"--model {missing}: no such folder" in capsys.readouterr().err
    assert not check_logprobs.looks_local("Qwen/Qwen3-0.6B")
