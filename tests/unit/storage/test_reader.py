"""capture.storage.reader: thread shards read back with late rewards joined, verl-style batches, torch."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capture.storage.reader import load_threads, to_batch, to_rl_batch, to_torch
from capture.storage.rewards import write_rewards
from capture.storage.shards import THREAD_SCHEMA, write_rows

PAD = 99


def thread_row(
    session_id: str,
    thread_id: str,
    input_ids: list[int],
    loss_mask: list[int],
    logprobs: list[float] | None = None,
    reward: float | None = None,
    metadata: dict[str, Any] | str | None = None,
    thread_kind: str | None = "main",
) -> dict[str, Any]:
    """A complete THREAD_SCHEMA row (what the proxy writes), with the fields under test set."""
    if logprobs is None:
        logprobs = [-0.5 * (i + 1) if m else 0.0 for i, m in enumerate(loss_mask)]
    return {
        "schema_version": 2,
        "session_id": session_id,
        "thread_id": thread_id,
        "parent_thread_id": None,
        "parent_relation": None,
        "parent_tool_call_id": None,
        "thread_kind": thread_kind,
        "dead": False,
        "dead_reason": None,
        "superseded_by": None,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "provenance": [1 if m else 0 for m in loss_mask],
        "turns": [],
        "num_turns": 1,
        "trained_request_ids": [],
        "protocol": "openai.chat",
        "user_agent": "test",
        "reward": reward,
        "metadata": metadata
        if metadata is None or isinstance(metadata, str)
        else json.dumps(metadata),
    }


# Two turns: prompt 10 11 12, sampled 20 21, environment (tool result) 30 31, sampled 22.
TWO_TURN = thread_row(
    "s1",
    "t-two",
    [10, 11, 12, 20, 21, 30, 31, 22],
    [0, 0, 0, 1, 1, 0, 0, 1],
    logprobs=[0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3],
    reward=1.0,
    metadata={"group_id": "g7", "task_id": "task-3", "split": "train"},
)
# One turn: prompt 40 41, sampled 50 51 52; no reward yet, no metadata.
ONE_TURN = thread_row(
    "s2", "t-one", [40, 41, 50, 51, 52], [0, 0, 1, 1, 1], logprobs=[0.0, 0.0, -1.0, -2.0, -3.0]
)


def _write_out(out: Path, rows: list[dict[str, Any]]) -> None:
    write_rows(out / "threads", rows, THREAD_SCHEMA, "threads")


# -- load_threads ---------------------------------------------------------------------------


@pytest.fixture
def out(tmp_path: Path) -> Path:
    out = tmp_path / "OUT"
    _write_out(
        out,
        [
            thread_row("s1", "t-a", [1, 2], [0, 1], reward=0.5),
            thread_row("s1", "t-b", [1, 3], [0, 1]),
        ],
    )
    _write_out(out, [thread_row("s2", "t-c", [4, 5], [0, 1], reward=0.25)])
    return out


def _rewards(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    return {r["thread_id"]: r["reward"] for r in rows}


def test_load_threads_without_late_rewards_reads_written_rows(out: Path) -> None:
    rows = load_threads(out / "threads")
    assert _rewards(rows) == {"t-a": 0.5, "t-b": None, "t-c": 0.25}
    assert set(rows[0]) == set(THREAD_SCHEMA.names)


def test_load_threads_joins_late_rewards_from_sibling_folder(out: Path) -> None:
    write_rewards(out, "s1", 1.0, set_at=10.0)
    write_rewards(out, "s1", {"t-b": -1.0}, set_at=20.0)
    expected = {"t-a": 1.0, "t-b": -1.0, "t-c": 0.25}
    assert _rewards(load_threads(out / "threads")) == expected
    assert _rewards(load_threads(out)) == expected  # OUT itself
    shard = sorted((out / "threads").glob("*.parquet"))
    one_file = [r for p in shard for r in load_threads(p)]
    assert _rewards(one_file) == expected  # one shard file: rewards from OUT/rewards too
    # rewards=False: the rows as written.
    assert _rewards(load_threads(out, rewards=False)) == {"t-a": 0.5, "t-b": None, "t-c": 0.25}


def test_load_threads_columns_subset_still_joins(out: Path) -> None:
    write_rewards(out, "s2", 2.0, set_at=1.0)
    rows = load_threads(out, columns=["reward", "input_ids"])
    assert all(set(r) == {"reward", "input_ids"} for r in rows)
    assert sorted((r["reward"] is None, r["reward"]) for r in rows) == [
        (False, 0.5),
        (False, 2.0),
        (True, None),
    ]
    # Without the reward column there is nothing to join, and nothing else is added.
    assert all(set(r) == {"input_ids"} for r in load_threads(out, columns=["input_ids"]))


def test_load_threads_out_without_threads_is_empty(tmp_path: Path) -> None:
    write_rewards(tmp_path, "s1", 1.0)
    assert load_threads(tmp_path) == []
    (tmp_path / "threads").mkdir()
    assert load_threads(tmp_path / "threads", columns=["reward"]) == []


# -- to_rl_batch ----------------------------------------------------------------------------


def test_rl_batch_two_turn_row_and_one_turn_row() -> None:
    batch = to_rl_batch([TWO_TURN, ONE_TURN], pad_id=PAD, missing_reward="zero")
    # Prompts: the tokens before the first trained one, left-padded.
    assert batch["prompts"].tolist() == [[10, 11, 12], [PAD, 40, 41]]
    # Responses: the rest, environment tokens included, right-padded.
    assert batch["responses"].tolist() == [[20, 21, 30, 31, 22], [50, 51, 52, PAD, PAD]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 1, 1, 0, 0]]
    assert np.allclose(
        batch["rollout_log_probs"], [[-0.1, -0.2, 0.0, 0.0, -0.3], [-1.0, -2.0, -3.0, 0.0, 0.0]]
    )
    assert batch["input_ids"].tolist() == [
        [10, 11, 12, 20, 21, 30, 31, 22],
        [PAD, 40, 41, 50, 51, 52, PAD, PAD],
    ]
    assert batch["attention_mask"].tolist() == [[1] * 8, [0, 1, 1, 1, 1, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [list(range(8)), [0, 0, 1, 2, 3, 4, 4, 4]]
    assert batch["reward"].tolist() == [1.0, 0.0]  # no reward yet: 0, as asked
    tlr = batch["token_level_rewards"]
    assert tlr[0].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]  # on the last trained token
    assert tlr[1].tolist() == [0.0] * 5
    assert batch["group_id"] == ["g7", "s2"]
    assert batch["session_id"] == ["s1", "s2"] and batch["thread_id"] == ["t-two", "t-one"]
    assert batch["prompts"].dtype == np.int64 and batch["rollout_log_probs"].dtype == np.float32
    assert batch["reward"].dtype == np.float64
    # The batch holds exactly the rows' tokens, in order, once padding is removed.
    for i, row in enumerate([TWO_TURN, ONE_TURN]):
        assert batch["input_ids"][i][batch["attention_mask"][i] == 1].tolist() == row["input_ids"]


def test_rl_batch_last_trained_token_is_not_last_response_token() -> None:
    # The row ends in environment tokens after its last sampled token.
    row = thread_row("s", "t", [1, 2, 3, 4, 5], [0, 1, 1, 0, 0], reward=-2.0)
    batch = to_rl_batch([row], pad_id=0)
    assert batch["responses"].tolist() == [[2, 3, 4, 5]]
    assert batch["token_level_rewards"].tolist() == [[0.0, -2.0, 0.0, 0.0]]


def test_rl_batch_fixed_widths_pad_to_the_limits() -> None:
    batch = to_rl_batch(
        [ONE_TURN], pad_id=PAD, max_prompt_len=4, max_response_len=6, missing_reward="zero"
    )
    assert batch["prompts"].tolist() == [[PAD, PAD, 40, 41]]
    assert batch["responses"].tolist() == [[50, 51, 52, PAD, PAD, PAD]]
    assert batch["input_ids"].shape == (1, 10) and batch["response_mask"].shape == (1, 6)
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4, 4, 4, 4]]


def test_rl_batch_group_id_sources() -> None:
    rows = [
        thread_row("s1", "t1", [1, 2], [0, 1], metadata={"group_id": "g"}),
        thread_row("s2", "t2", [1, 2], [0, 1], metadata={"task_id": "x"}),  # no group_id
        thread_row("s3", "t3", [1, 2], [0, 1], metadata={"group_id": 5}),  # not a string
        thread_row("s4", "t4", [1, 2], [0, 1], metadata="{not json"),
        thread_row("s5", "t5", [1, 2], [0, 1], metadata="[1, 2]"),  # JSON, not an object
    ]
    assert to_rl_batch(rows, pad_id=0, missing_reward="zero")["group_id"] == [
        "g",
        "s2",
        "5",
        "s4",
        "s5",
    ]


def test_rl_batch_row_that_trains_nothing_has_an_empty_response() -> None:
    rows = [ONE_TURN, thread_row("s9", "t-ctx", [7, 8, 9], [0, 0, 0], reward=1.0)]
    batch = to_rl_batch(rows, pad_id=PAD, missing_reward="zero")
    assert batch["prompts"].tolist() == [[PAD, 40, 41], [7, 8, 9]]
    assert batch["responses"][1].tolist() == [PAD, PAD, PAD]
    assert batch["response_mask"][1].tolist() == [0, 0, 0]
    assert batch["token_level_rewards"][1].tolist() == [0.0, 0.0, 0.0]


def test_rl_batch_empty() -> None:
    batch = to_rl_batch([], pad_id=0, max_prompt_len=3, max_response_len=2)
    assert batch["input_ids"].shape == (0, 5) and batch["reward"].shape == (0,)
    assert batch["session_id"] == []


# -- truncation -----------------------------------------------------------------------------

LONG = thread_row(
    "s", "t-long", [1, 2, 3, 4, 5, 6, 20, 30, 21], [0, 0, 0, 0, 0, 0, 1, 0, 1], reward=3.0
)


def test_truncation_error_names_row_and_lengths() -> None:
    with pytest.raises(ValueError) as info:
        to_rl_batch([ONE_TURN, LONG], pad_id=0, max_prompt_len=4, missing_reward="zero")
    message = str(info.value)
    assert (
        "row 1" in message
        and "t-long" in message
        and "6 tokens" in message
        and "max_prompt_len=4" in message
    )
    with pytest.raises(ValueError) as info:
        to_rl_batch([LONG], pad_id=0, max_response_len=2)
    message = str(info.value)
    assert "t-long" in message and "3 tokens" in message and "max_response_len=2" in message


def test_truncation_left_right_middle_for_prompts() -> None:
    left = to_rl_batch([LONG], pad_id=0, max_prompt_len=4, truncation="left")
    assert left["prompts"].tolist() == [[3, 4, 5, 6]]
    right = to_rl_batch([LONG], pad_id=0, max_prompt_len=4, truncation="right")
    assert right["prompts"].tolist() == [[1, 2, 3, 4]]
    middle = to_rl_batch([LONG], pad_id=0, max_prompt_len=5, truncation="middle")
    assert middle["prompts"].tolist() == [[1, 2, 4, 5, 6]]
    # The response is untouched by the prompt's cut.
    assert left["responses"].tolist() == [[20, 30, 21]] and left["response_mask"].tolist() == [
        [1, 0, 1]
    ]


def test_truncation_cuts_responses_at_their_end() -> None:
    batch = to_rl_batch(
        [LONG, ONE_TURN], pad_id=PAD, max_response_len=2, truncation="left", missing_reward="zero"
    )
    assert batch["responses"].tolist() == [[20, 30], [50, 51]]
    assert batch["response_mask"].tolist() == [[1, 0], [1, 1]]
    assert np.allclose(batch["rollout_log_probs"][0], [-3.5, 0.0])
    # The reward moves to the last trained token that is left.
    assert batch["token_level_rewards"][0].tolist() == [3.0, 0.0]
    assert batch["attention_mask"].tolist() == [[1] * 8, [0] * 4 + [1, 1] + [1, 1]]


def test_truncation_rows_within_limits_are_unchanged() -> None:
    plain = to_rl_batch([TWO_TURN], pad_id=0)
    limited = to_rl_batch([TWO_TURN], pad_id=0, max_prompt_len=3, max_response_len=5)
    for key in ("prompts", "responses", "response_mask", "input_ids", "position_ids"):
        assert np.array_equal(plain[key], limited[key]), key  # type: ignore[literal-required]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"truncation": "both"},
        {"max_prompt_len": 0},
        {"max_response_len": -1},
        {"max_response_len": 2.5},
        {"missing_reward": "nan"},
        {"kinds": ("main", "helper")},
    ],
)
def test_bad_batch_options(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        to_rl_batch([ONE_TURN], pad_id=0, **{"missing_reward": "zero", **kwargs})


def test_misaligned_or_missing_columns() -> None:
    bad = dict(ONE_TURN, logprobs=[0.0])
    with pytest.raises(ValueError, match="differ in length"):
        to_rl_batch([bad], pad_id=0, missing_reward="zero")
    with pytest.raises(ValueError, match="logprobs"):
        to_rl_batch(
            [{k: v for k, v in ONE_TURN.items() if k != "logprobs"}],
            pad_id=0,
            missing_reward="zero",
        )


def test_rl_batch_from_shards_with_late_reward(tmp_path: Path) -> None:
    _write_out(tmp_path, [TWO_TURN, ONE_TURN])
    write_rewards(tmp_path, "s2", 0.5)
    rows = sorted(load_threads(tmp_path), key=lambda r: r["thread_id"])
    batch = to_rl_batch(rows, pad_id=PAD)
    assert batch["thread_id"] == ["t-one", "t-two"]
    assert batch["reward"].tolist() == [0.5, 1.0]
    assert batch["token_level_rewards"][0].tolist() == [0.0, 0.0, 0.5, 0.0, 0.0]
    assert batch["group_id"] == ["s2", "g7"]


# -- rows without a reward, thread kinds ----------------------------------------------------


def test_rows_without_a_reward_are_refused_naming_their_sessions() -> None:
    rows = [thread_row("s-ok", "t", [1, 2], [0, 1], reward=1.0)]
    rows += [thread_row(f"s-{i}", "t", [1, 2], [0, 1]) for i in range(7)]
    rows.append(thread_row("s-0", "t-2", [1, 2], [0, 1]))  # named once
    with pytest.raises(ValueError) as info:
        to_rl_batch(rows, pad_id=0)
    message = str(info.value)
    assert "8 of 9 rows have no reward" in message
    assert "'s-0', 's-1', 's-2', 's-3', 's-4' and 2 more" in message and "s-ok" not in message
    assert "missing_reward='drop'" in message and "missing_reward='zero'" in message
    assert "kinds=('main', 'subagent')" in message


def test_missing_reward_drop_and_zero() -> None:
    rows = [TWO_TURN, ONE_TURN, thread_row("s3", "t3", [1, 2], [0, 1], reward=-1.0)]
    dropped = to_rl_batch(rows, pad_id=PAD, missing_reward="drop")
    assert dropped["thread_id"] == ["t-two", "t3"] and dropped["reward"].tolist() == [1.0, -1.0]
    assert dropped["input_ids"].shape[0] == 2
    zero = to_rl_batch(rows, pad_id=PAD, missing_reward="zero")
    assert zero["thread_id"] == ["t-two", "t-one", "t3"]
    assert zero["reward"].tolist() == [1.0, 0.0, -1.0]
    assert not np.isnan(zero["token_level_rewards"]).any()
    # Every row rewarded: all three give the same batch.
    full = [TWO_TURN, rows[2]]
    for how in ("error", "drop", "zero"):
        batch = to_rl_batch(full, pad_id=PAD, missing_reward=how)  # type: ignore[arg-type]
        assert batch["reward"].tolist() == [1.0, -1.0]


def test_auxiliary_rows_without_a_reward_need_a_choice() -> None:
    """A session's reward leaves its auxiliary rows (a title call) without one: the batch says
    so unless they are filtered out; rows written before the column existed count as main."""
    main = thread_row("s", "t-main", [1, 2, 3], [0, 1, 1], reward=1.0)
    sub = thread_row("s", "t-sub", [1, 4], [0, 1], reward=1.0, thread_kind="subagent")
    title = thread_row("s", "t-title", [7, 8], [0, 1], thread_kind="auxiliary")
    old = thread_row("s0", "t-old", [5, 6], [0, 1], reward=0.0, thread_kind=None)
    rows = [main, sub, title, old]
    with pytest.raises(ValueError, match=r"1 of 4 rows have no reward \(1 of them auxiliary"):
        to_rl_batch(rows, pad_id=0)
    batch = to_rl_batch(rows, pad_id=0, kinds=("main", "subagent"))
    assert batch["thread_id"] == ["t-main", "t-sub", "t-old"]
    assert to_rl_batch(rows, pad_id=0, kinds="auxiliary", missing_reward="zero")["thread_id"] == [
        "t-title"
    ]
    assert to_rl_batch(rows, pad_id=0, kinds=["main"])["thread_id"] == ["t-main", "t-old"]


def test_load_threads_reads_shards_from_before_thread_kind(tmp_path: Path) -> None:
    """A folder mixing shards written before the thread_kind column with newer ones reads the
    column from every file (null for the old rows), whichever file comes first."""
    old_schema = THREAD_SCHEMA.remove(THREAD_SCHEMA.get_field_index("thread_kind"))
    for first, second in (("a", "b"), ("b", "a")):
        out = tmp_path / first
        old = {k: v for k, v in thread_row("s1", "t-old", [1, 2], [0, 1]).items()}
        del old["thread_kind"]
        write_rows(out / "threads", [old], old_schema, "threads", stem=first)
        new = thread_row("s2", "t-new", [1, 2], [0, 1], thread_kind="auxiliary")
        write_rows(out / "threads", [new], THREAD_SCHEMA, "threads", stem=second)
        rows = {r["thread_id"]: r for r in load_threads(out)}
        assert rows["t-old"]["thread_kind"] is None
        assert rows["t-new"]["thread_kind"] == "auxiliary"
        assert len(load_threads(out, columns=["thread_id", "thread_kind"])) == 2


# -- to_batch / to_torch --------------------------------------------------------------------


def test_to_batch_still_pads_whole_rows() -> None:
    batch = to_batch([ONE_TURN, TWO_TURN], pad_id=PAD)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][0].tolist() == [40, 41, 50, 51, 52, PAD, PAD, PAD]
    assert batch["loss_mask"][1].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]


def test_to_torch_without_torch_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails, as when missing
    batch = to_rl_batch([ONE_TURN], pad_id=0, missing_reward="zero")  # numpy needs no torch
    with pytest.raises(ImportError, match="pip install torch"):
        to_torch(batch)


def test_to_torch_converts_arrays_and_passes_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torch")
    fake.from_numpy = lambda a: ("tensor", a)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake)
    batch = to_rl_batch([ONE_TURN], pad_id=0, missing_reward="zero")
    tensors = to_torch(batch)
    assert tensors["prompts"][0] == "tensor" and tensors["prompts"][1] is batch["prompts"]
    assert tensors["session_id"] is batch["session_id"] and tensors["group_id"] == ["s2"]
    assert set(tensors) == set(batch)


def test_rl_batch_weight_versions_of_the_trained_tokens() -> None:
    row = thread_row("s", "t", [1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 1], reward=1.0)
    # step-9 sampled a context token only (masked here); step-10 sorts after step-9.
    row["weight_versions"] = [
        {"version": "step-9", "start": 0, "end": 1},
        {"version": "step-10", "start": 1, "end": 3},
        {"version": "step-11", "start": 4, "end": 6},
    ]
    old = thread_row("s", "u", [1, 2], [0, 1], reward=1.0)  # written before the column
    batch = to_rl_batch([row, old], pad_id=0)
    assert batch["min_weight_version"] == ["step-10", None]
    assert batch["max_weight_version"] == ["step-11", None]
