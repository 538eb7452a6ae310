"""Admission by resources (capture/rollouts/admission.py): promises within the budget, a wait
that ends when memory is given back, a rollout too big for the budget refused at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from capture.isolation.limits import SandboxLimits
from capture.rollouts.admission import (
    MemoryBudget,
    MemoryBusy,
    NeverFits,
    host_memory_mb,
    run_need_mb,
)


def test_a_run_is_promised_its_memory_and_its_tmpfs() -> None:
    assert run_need_mb(SandboxLimits(memory_mb=1000, disk_mb=300)) == 1300


def test_host_memory_is_memtotal(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24576000 kB\nMemFree: 1 kB\n")
    assert host_memory_mb(info) == 24000
    assert host_memory_mb() > 0


def test_promises_stay_within_the_budget() -> None:
    budget = MemoryBudget(10_000)
    budget.take(6_000)
    with pytest.raises(MemoryBusy, match="6000 of 10000 MiB are promised"):
        budget.take(5_000)
    budget.take(4_000)
    with pytest.raises(NeverFits, match="more than the 10000 MiB"):
        budget.take(10_001)
    budget.give_back(6_000)
    assert budget.promised_mb == 4_000 and budget.fits(6_000) and not budget.fits(6_001)


def test_a_waiting_agent_starts_when_memory_is_given_back() -> None:
    async def scenario() -> list[str]:
        budget = MemoryBudget(10_000)
        budget.take(8_000)
        events: list[str] = []

        async def waiter() -> None:
            assert await budget.acquire(5_000)
            events.append("admitted")

        task = asyncio.ensure_future(waiter())
        for _ in range(5):
            await asyncio.sleep(0)
        events.append("still waiting" if not task.done() else "too early")
        budget.give_back(8_000)
        await asyncio.wait_for(task, 5)
        assert budget.promised_mb == 5_000
        return events

    assert asyncio.run(scenario()) == ["still waiting", "admitted"]


def test_a_cancelled_waiter_gives_up_without_a_promise() -> None:
    async def scenario() -> bool:
        budget = MemoryBudget(10_000)
        budget.take(8_000)
        cancelled = False
        task = asyncio.ensure_future(budget.acquire(5_000, lambda: cancelled))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        cancelled = True
        budget.nudge()
        got = await asyncio.wait_for(task, 5)
        assert budget.promised_mb == 8_000
        return got

    assert asyncio.run(scenario()) is False


def test_a_wait_for_more_than_the_budget_ends_at_once() -> None:
    with pytest.raises(NeverFits):
        asyncio.run(MemoryBudget(100).acquire(101))
