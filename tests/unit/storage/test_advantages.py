"""The trainer's own advantages (capture/storage/advantages.py): one line each, the last one for a
session wins, anything but a finite number refused; the viewer's group shows them in place of
its estimate (capture/viewer/run.py ``group_view``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from capture.storage.advantages import (
    ADVANTAGES_FILE,
    load_advantages,
    parse_advantage,
    parse_step,
    parse_step_s,
    write_advantage,
)
from capture.viewer.run import group_view


def test_the_last_advantage_of_a_session_wins(tmp_path: Path) -> None:
    assert load_advantages(tmp_path) == {}
    write_advantage(tmp_path, "s-1", 0.5, 1)
    write_advantage(tmp_path, "s-2", -1.25, None)
    write_advantage(tmp_path, "s-1", 2.0, 2)
    found = load_advantages(tmp_path)
    assert {sid: (a["advantage"], a["step"]) for sid, a in found.items()} == {
        "s-1": (2.0, 2),
        "s-2": (-1.25, None),
    }


def test_the_trainers_step_time_is_kept_where_it_gave_one(tmp_path: Path) -> None:
    write_advantage(tmp_path, "s-1", 0.5, 1, step_s=41.5)
    write_advantage(tmp_path, "s-2", 0.5, 1)
    found = load_advantages(tmp_path)
    assert (found["s-1"]["step_s"], found["s-2"]["step_s"]) == (41.5, None)
    # A line whose step time is not one (written by hand) is skipped like any bad line.
    with open(tmp_path / ADVANTAGES_FILE, "a") as fh:
        fh.write('{"session_id": "s-3", "advantage": 1.0, "step_s": -2}\n')
    assert "s-3" not in load_advantages(tmp_path)


@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf, 10**400, "3", True, [1.0]])
def test_a_step_time_is_a_finite_number_of_seconds_from_0(value: Any) -> None:
    with pytest.raises(ValueError, match='"step_s" must be a finite number of seconds'):
        parse_step_s(value)
    assert parse_step_s(None) is None and parse_step_s(0) == 0.0 and parse_step_s(2) == 2.0


def test_a_line_that_is_not_an_advantage_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_advantage(tmp_path, "s-1", 0.5, 1)
    with open(tmp_path / ADVANTAGES_FILE, "a") as fh:
        fh.write('{"session_id": "s-2", "advantage": "NaN"}\n{"session_id": "s-3", "adv')
    assert list(load_advantages(tmp_path)) == ["s-1"]
    assert "2 line(s) are not advantages" in caplog.text
    # An integer past a float's range (an edit; the API's body reader refuses it) is a bad line
    # too, not an OverflowError out of the viewer.
    with open(tmp_path / ADVANTAGES_FILE, "a") as fh:
        fh.write('\n{"session_id": "s-4", "advantage": 1' + "0" * 400 + "}\n")
    assert list(load_advantages(tmp_path)) == ["s-1"]


@pytest.mark.parametrize("value", [math.nan, math.inf, 10**400, "1.0", True, None, [1.0]])
def test_only_a_finite_number_is_an_advantage(value: Any) -> None:
    with pytest.raises(ValueError, match='"advantage" must be a finite number'):
        parse_advantage(value)
    assert parse_advantage(3) == 3.0 and isinstance(parse_advantage(3), float)


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_a_step_is_a_whole_number_from_0(value: Any) -> None:
    with pytest.raises(ValueError, match='"step" must be a whole number'):
        parse_step(value)
    assert parse_step(None) is None and parse_step(0) == 0


def session(sid: str, reward: float, index: int) -> dict[str, Any]:
    return {
        "id": sid, "metadata": {"group_id": "g", "index": index}, "reward": reward,
        "status": "stop", "calls": 1, "tokens": 10, "trained_tokens": 5, "end_reason": "stop",
        "versions": ["v1"],
    }  # fmt: skip


def test_a_group_shows_the_trainers_advantage_where_it_sent_one() -> None:
    sessions = [session("a", 1.0, 0), session("b", 0.0, 1)]
    own = group_view(sessions, [], "g")
    assert own["advantage_source"] == "estimate"
    assert [r["advantage"] for r in own["rollouts"]] == [0.5, -0.5]
    trainer = {"a": {"advantage": 0.7071, "step": 1}, "b": {"advantage": -0.7071, "step": 1}}
    given = group_view(sessions, [], "g", trainer)
    assert given["advantage_source"] == "trainer"
    assert [r["advantage"] for r in given["rollouts"]] == [0.7071, -0.7071]
    mixed = group_view(sessions, [], "g", {"a": trainer["a"]})
    assert mixed["advantage_source"] == "mixed"
    assert [(r["advantage"], r["advantage_source"]) for r in mixed["rollouts"]] == [
        (0.7071, "trainer"),
        (-0.5, "estimate"),
    ]
