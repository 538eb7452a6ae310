"""Seeded rollouts (issue 40 item 5): ``POST /rollouts {"seed"}`` is read, each agent's session
gets a seed of its own from it and each call one from that and its prompt, and the TRL adapter
names and seeds its rollouts by the run's seed, the step and the task, so a run repeats."""

from __future__ import annotations

from typing import Any

import pytest

import capture.train.trl as train_trl
from capture.client.launcher import AgentTapError
from capture.control.sessions import SessionControl, agent_seed, call_seed
from capture.rollouts.spec import parse_rollout
from capture.train.trl import make_rollout_func, rollout_seed
from tests.unit.train.test_rows import FakeTap


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_trl, "POLL_S", 0.0)


def test_a_rollouts_seed_is_read_and_a_bad_one_refused() -> None:
    assert parse_rollout({"agent": "codex", "prompt": "x", "seed": 7}).seed == 7
    assert parse_rollout({"agent": "codex", "prompt": "x", "seed": -3}).seed == -3
    assert parse_rollout({"agent": "codex", "prompt": "x"}).seed is None
    for bad in (True, "7", 7.0, [7]):
        with pytest.raises(ValueError, match='"seed" must be a whole number'):
            parse_rollout({"agent": "codex", "prompt": "x", "seed": bad})


def test_seeds_are_the_same_for_the_same_inputs_and_differ_otherwise() -> None:
    assert agent_seed(7, 0) == agent_seed(7, 0)
    assert len({agent_seed(7, 0), agent_seed(7, 1), agent_seed(8, 0)}) == 3
    assert call_seed(5, [1, 2, 3]) == call_seed(5, [1, 2, 3])
    assert len({call_seed(5, [1, 2, 3]), call_seed(5, [1, 2, 4]), call_seed(6, [1, 2, 3])}) == 3
    # Within what every server takes (vLLM: a 64-bit integer; others: 32-bit).
    assert all(0 <= s < 2**31 for s in (agent_seed(-1, 3), call_seed(2**40, [151_000] * 9)))


def test_a_seeded_sessions_calls_get_seeds_and_others_none() -> None:
    control = SessionControl()
    seeded = control.open("a", {})
    seeded.seed = agent_seed(7, 0)
    control.open("b", {})
    assert control.sampling_seed("a", [1, 2]) == call_seed(agent_seed(7, 0), [1, 2])
    assert control.sampling_seed("b", [1, 2]) is None
    assert control.sampling_seed("never-opened", [1, 2]) is None
    assert control.get("a").summary()["seed"] == agent_seed(7, 0)  # type: ignore[union-attr]
    assert "seed" not in control.get("b").summary()  # type: ignore[union-attr]


def started(seed: int | None, steps: int = 2) -> list[dict[str, Any]]:
    """The rollouts a seeded TRL rollout function starts over ``steps`` calls (no trainer: the
    calls are counted), two tasks each."""
    tap = FakeTap()
    func = make_rollout_func(tap, agent="codex", seed=seed)  # type: ignore[arg-type]
    for _ in range(steps):
        func(["aa", "aa", "bbb", "bbb"], None)
    return tap.started


def test_the_trl_adapter_seeds_and_names_rollouts_by_seed_step_and_task() -> None:
    first, again = started(3), started(3)
    assert [(s["id"], s["seed"]) for s in first] == [(s["id"], s["seed"]) for s in again]
    assert [s["id"] for s in first] == ["s3-step0-0", "s3-step0-1", "s3-step1-0", "s3-step1-1"]
    assert [s["seed"] for s in first] == [rollout_seed(3, k // 2, k % 2) for k in range(4)]
    assert len({s["seed"] for s in first}) == 4
    assert not {s["seed"] for s in first} & {s["seed"] for s in started(4)}
    # Unseeded: agenttap names the rollouts and the policy samples its own way.
    assert all("seed" not in s and "id" not in s for s in started(None))


def test_the_step_is_the_trainers_where_it_gives_one() -> None:
    class Trainer:
        class state:  # noqa: N801 (TRL's attribute name)
            global_step = 12

    tap = FakeTap()
    make_rollout_func(tap, agent="codex", seed=0)(["x"], Trainer())  # type: ignore[arg-type]
    assert tap.started[0]["id"] == "s0-step12-0"


def test_a_seeded_rollout_whose_name_is_taken_says_what_to_do() -> None:
    class TakenTap(FakeTap):
        def rollout(self, agent: Any, prompt: str, n: int = 1, **options: Any) -> dict[str, Any]:
            raise AgentTapError(f"POST /rollouts: 400 rollout id {options['id']!r} is in use", 400)

    func = make_rollout_func(TakenTap(), agent="codex", seed=1)  # type: ignore[arg-type]
    with pytest.raises(AgentTapError, match="fresh agenttap, or give another seed"):
        func(["x"], None)
