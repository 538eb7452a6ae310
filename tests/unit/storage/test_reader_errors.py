"""``load_threads`` on a path without shards says what it looked for and where shards are if
they are near (issue 40): a mistyped OUT, an example's ``--out`` folder whose shards are one
folder down."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capture.storage.reader import load_threads
from tests.support.viewer_data import write_long_prompt_session


@pytest.fixture
def here(tmp_path: Path) -> Path:
    """A working folder: an example's run (its shards in grpo-run/shards, its batch beside),
    a proxy's OUT (rollouts/), and a folder of other things."""
    write_long_prompt_session(tmp_path / "grpo-run" / "shards", prompt=20, sampled=5)
    (tmp_path / "grpo-run" / "batch.json").write_text("{}")
    write_long_prompt_session(tmp_path / "rollouts", prompt=20, sampled=5)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    return tmp_path


def test_a_folder_whose_shards_are_one_folder_down(here: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_threads(here / "grpo-run")
    text = str(err.value)
    assert "holds no .parquet file and no threads/ folder" in text
    assert "batch.json" in text and "load_threads reads OUT" in text
    assert f"Did you mean {here / 'grpo-run' / 'shards'} (1 thread shard)?" in text
    # Where it pointed, the rows are.
    assert len(load_threads(here / "grpo-run" / "shards")) == 1


def test_a_mistyped_folder_gets_the_one_named_like_it(here: Path) -> None:
    cwd = os.getcwd()
    os.chdir(here)
    try:
        with pytest.raises(FileNotFoundError) as err:
            load_threads("rollout")
    finally:
        os.chdir(cwd)
    text = str(err.value)
    assert "no thread shards at 'rollout': it does not exist" in text
    assert "Did you mean rollouts (1 thread shard)?" in text and "grpo-run" not in text


def test_without_shards_near_it_says_what_it_wanted(here: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_threads(here / "notes")
    assert "a.txt" in str(err.value) and "Did you mean" not in str(err.value)
    empty = here / "empty"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_threads(empty / "x")
    # A folder with nothing in it yet, or an OUT with no threads yet: no rows, no error.
    empty.mkdir()
    assert load_threads(empty) == []
    (here / "fresh" / "turns").mkdir(parents=True)
    assert load_threads(here / "fresh") == []
