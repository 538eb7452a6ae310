"""capture/isolation/budget.py: a sandbox's connections at once, and the process's reserve."""

from __future__ import annotations

import resource

import pytest

from capture.isolation.budget import (
    FDS_PER_CONNECTION,
    RECOUNT_S,
    ConnectionBudget,
    Descriptors,
    open_descriptors,
    raise_nofile,
    reserve_for,
)
from capture.options import parse_settings


def test_a_sandbox_holds_at_most_its_budget_and_refusals_are_counted() -> None:
    budget = ConnectionBudget(3)
    assert [budget.take() for _ in range(5)] == [True, True, True, False, False]
    assert (budget.open, budget.peak, budget.refused) == (3, 3, 2)
    budget.give_back()
    assert budget.take() and not budget.take()
    for _ in range(10):
        budget.give_back()  # more than it took: never below zero
    assert budget.open == 0 and budget.peak == 3 and budget.refused == 3
    with pytest.raises(ValueError):
        ConnectionBudget(0)


def test_the_reserve_is_a_quarter_at_least_1024_at_most_half() -> None:
    assert reserve_for(20_000) == 5_000  # mitmdump's limit as measured: 3,000 relayed
    assert Descriptors(20_000, count=lambda: 0).max_relayed == 3_000
    assert reserve_for(1_024) == 512
    assert reserve_for(2_048) == 1_024
    assert reserve_for(1 << 20) == 1 << 18


def test_new_connections_stop_before_the_reserve_from_what_is_really_open() -> None:
    now = [0.0]
    open_now = [1_000]
    fds = Descriptors(2_000, reserve=500, count=lambda: open_now[0], clock=lambda: now[0])
    assert fds.usable == 1_500
    # 1,000 open: room for 100 connections of FDS_PER_CONNECTION before 1,500.
    taken = 0
    while fds.take():
        taken += 1
    assert taken == (1_500 - 1_000) // FDS_PER_CONNECTION and fds.refused == 1
    # Something else opened descriptors (the trainer's sessions): seen at the next count.
    for _ in range(taken):
        fds.give_back()
    open_now[0] = 1_497
    now[0] += RECOUNT_S
    assert not fds.take() and fds.refused == 2
    open_now[0] = 900
    now[0] += RECOUNT_S
    assert fds.take() and fds.relayed == 1


def test_the_relayed_total_is_capped_without_proc() -> None:
    fds = Descriptors(2_000, reserve=1_000, count=lambda: None)
    taken = sum(fds.take() for _ in range(500))
    assert taken == fds.max_relayed == 1_000 // FDS_PER_CONNECTION


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, before[1]), before[1]))
        limit = raise_nofile()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert limit == (soft if soft != resource.RLIM_INFINITY else 1 << 20)
        assert soft == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
    counted = open_descriptors()
    assert counted is not None and counted > 0


def test_agenttap_rollout_max_connections_is_parsed() -> None:
    assert parse_settings({}).rollout_max_connections == 64
    assert parse_settings({"agenttap_rollout_max_connections": "8"}).rollout_max_connections == 8
    for bad, words in (("0", "more than zero"), ("-1", "zero or more"), ("many", "whole"),
                       ("4097", "more than 4096"), ("1.5", "whole")):  # fmt: skip
        with pytest.raises(ValueError) as refused:
            parse_settings({"agenttap_rollout_max_connections": bad})
        assert "agenttap_rollout_max_connections" in str(refused.value), bad
        assert words in str(refused.value), (bad, str(refused.value))
