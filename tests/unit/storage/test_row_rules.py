"""capture.storage.row_rules: a row's reward, its weight versions and their order, one rule each
for the reader, the trainer adapters and the viewer."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from capture.storage.reader import to_rl_batch
from capture.storage.row_rules import (
    ordered_versions,
    reward_value,
    row_reward,
    row_versions,
    rows_versions,
    span_versions,
    version_key,
    version_step,
    weight_steps,
)
from capture.train.rows import verl_fields
from capture.viewer import data as viewer


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (1.0, 1.0),
        (0, 0.0),
        (-2, -2.0),
        ("0.5", 0.5),  # a numeric string reads as its number
        (np.float32(0.25), 0.25),  # a numpy scalar (not a float subclass) too
        (None, None),
        (True, None),  # a boolean is not a reward
        (False, None),
        (math.nan, None),
        (math.inf, None),
        (-math.inf, None),
        ("inf", None),
        ("one", None),
        ([1.0], None),
        (10**400, None),  # an integer past float64
    ],
)
def test_a_reward_is_a_finite_number_or_none(value: Any, want: float | None) -> None:
    got = reward_value(value)
    assert got == want
    assert got is None or isinstance(got, float)
    assert row_reward({"reward": value}) == want
    assert row_reward({}) is None


def test_versions_sort_numbers_as_numbers_default_first() -> None:
    labels = ["step-10", "step-9", "default", "10", "2", "base", "step-9"]
    assert ordered_versions(labels) == ["default", "2", "10", "base", "step-9", "step-10"]
    assert ordered_versions([None, "v1", None]) == ["v1"]
    assert version_key("default") < version_key("0") < version_key("a")
    assert version_key("v2") < version_key("v10")
    assert sorted(["v10", "v2", "v1"], key=version_key) == ["v1", "v2", "v10"]


def test_version_steps() -> None:
    assert version_step("12") == 12 and version_step(" 7 ") == 7
    assert version_step("step-12") == 12  # the trailing number, not -12
    assert version_step("default") is None and version_step("v1-final") is None


MASK = [0, 0, 1, 1, 0, 1, 1, 0]


def row(spans: Any, mask: Any = MASK, reward: Any = 1.0) -> dict[str, Any]:
    n = len(mask) if mask else 8
    return {
        "session_id": "s",
        "thread_id": "t",
        "input_ids": list(range(n)),
        "loss_mask": mask,
        "logprobs": [0.0] * n,
        "weight_versions": spans,
        "reward": reward,
    }


# Named newest first, with a span over prompt tokens only (step-1) and one with no label.
SPANS = [
    {"version": "step-10", "start": 5, "end": 7},
    {"version": "step-9", "start": 2, "end": 4},
    {"version": "step-1", "start": 0, "end": 2},
    {"version": None, "start": 7, "end": 8},
]


def test_a_rows_versions_are_trained_ones_oldest_first() -> None:
    assert row_versions(row(SPANS)) == ["step-9", "step-10"]
    assert row_versions(row(SPANS), trained_only=False) == ["step-1", "step-9", "step-10"]
    # Read without its loss mask: every span counts.
    assert row_versions(row(SPANS, mask=None)) == ["step-1", "step-9", "step-10"]
    assert row_versions(row(None)) == [] and row_versions(row([])) == []
    assert weight_steps(row(SPANS)) == (9, 10)
    assert weight_steps(row([{"version": "default", "start": 2, "end": 4}])) == (None, None)


def test_span_versions_of_positions() -> None:
    assert span_versions(SPANS, 1, 3) == ["step-1", "step-9"]  # overlapping [1, 3)
    assert span_versions(SPANS, 4, 5) == []
    assert span_versions(SPANS) == ["step-1", "step-9", "step-10"]
    session = [row(SPANS[:1]), row([{"version": "step-2", "start": 0, "end": 1}])]
    assert rows_versions(session) == ["step-2", "step-10"]


def test_the_reader_the_trainer_and_the_viewer_read_a_row_alike() -> None:
    """One row, three readers: the same versions in the same order, the same reward."""
    one = row(SPANS, reward=0.5)
    batch = to_rl_batch([one], pad_id=0)
    assert batch["min_weight_version"] == ["step-9"] and batch["max_weight_version"] == ["step-10"]
    assert batch["reward"].tolist() == [0.5]
    fields = verl_fields({"rows": [one], "reward": 0.5}, 8, 8)
    assert fields["extra_fields"]["agenttap_weight_versions"] == ["step-9", "step-10"]
    assert fields["reward_score"] == 0.5
    node = viewer.row_node(one)
    assert node["versions"] == ["step-1", "step-9", "step-10"]  # the viewer shows every span
    assert node["reward"] == 0.5
    (session,) = viewer.session_list([dict(one, tokens=8, trained_tokens=4)])
    assert session["versions"] == ["step-1", "step-9", "step-10"]
    assert viewer.session_value(session, "version") == "step-10"  # the newest


def test_a_non_finite_reward_is_none_everywhere() -> None:
    bad = row(SPANS, reward=math.inf)
    with pytest.raises(ValueError, match="no reward"):
        to_rl_batch([bad], pad_id=0)
    assert to_rl_batch([bad], pad_id=0, missing_reward="zero")["reward"].tolist() == [0.0]
    assert verl_fields({"rows": [bad], "reward": math.inf}, 8, 8)["reward_score"] is None
    assert viewer.row_node(bad)["reward"] is None
    rows = [dict(bad, tokens=8, trained_tokens=4), dict(bad, thread_id="u", reward=0.5)]
    (session,) = viewer.session_list(rows)
    assert session["reward"] == 0.5 and viewer.reward_of(session) == 0.5
    assert viewer.reward_of({"reward": [1.0, math.nan, 0.0]}) == 0.5


def test_the_viewer_sorts_weight_versions_by_the_row_rules() -> None:
    names = ["step-10", "default", "step-9"]
    sessions = [
        {"id": f"s{k}", "status": "stop", "versions": [v], "metadata": {}}
        for k, v in enumerate(names)
    ]
    up = viewer.query_sessions(sessions, "version", descending=False)["sessions"]
    assert [s["versions"][0] for s in up] == ["default", "step-9", "step-10"]
    for s in sessions:
        s.update(tokens=0, trained_tokens=0, calls=0)
    steps = viewer.run_summary(sessions, "version")["steps"]
    assert [p["step"] for p in steps] == ["default", "step-9", "step-10"]
