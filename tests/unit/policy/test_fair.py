"""The fair scheduler (capture/policy/fair.py) and its two uses (a session's bound over the policy,
capture/policy/pools.py; a server's slots, capture/policy/replicas.py): grants in order, the
bounds, turns between sessions, waiters that leave, and no slot lost on the way. No network:
every wait is on the scheduler's own futures."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from capture.policy.fair import FairScheduler, QueueFull
from capture.policy.pools import Generation
from capture.policy.replicas import ReplicasBusy, ReplicaSet


async def settle() -> None:
    """Let every task that can run, run (a granted waiter resumes on the next loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


class Calls:
    """Calls that take a slot and note when they got it, in order."""

    def __init__(self, sched: FairScheduler) -> None:
        self.sched = sched
        self.granted: list[str] = []
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def _one(self, name: str, session: str) -> None:
        await self.sched.acquire(session)
        self.granted.append(name)

    async def start(self, name: str, session: str) -> None:
        self.tasks[name] = asyncio.create_task(self._one(name, session))
        await settle()


async def test_slots_are_granted_at_once_up_to_the_capacity_then_in_order() -> None:
    sched = FairScheduler(capacity=2)
    calls = Calls(sched)
    for name in ("a1", "a2", "a3", "a4"):
        await calls.start(name, "a")
    assert calls.granted == ["a1", "a2"] and sched.in_flight == 2 and sched.waiting == 2
    sched.release("a")
    await settle()
    assert calls.granted == ["a1", "a2", "a3"] and sched.waiting == 1
    sched.release("a")
    await settle()
    assert calls.granted == ["a1", "a2", "a3", "a4"] and sched.waiting == 0
    assert sched.in_flight == 2


async def test_a_session_past_its_own_bound_waits_while_another_runs_at_once() -> None:
    sched = FairScheduler(per_session=2)
    calls = Calls(sched)
    for name in ("h1", "h2", "h3"):
        await calls.start(name, "hog")
    await calls.start("v1", "victim")
    assert calls.granted == ["h1", "h2", "v1"]
    assert sched.running_of("hog") == 2 and sched.waiting_of("hog") == 1
    sched.release("victim")  # another session's end frees nothing of the hog's bound
    await settle()
    assert calls.granted == ["h1", "h2", "v1"]
    sched.release("hog")
    await settle()
    assert calls.granted[-1] == "h3" and sched.running_of("hog") == 2


async def test_sessions_take_turns_for_a_saturated_capacity() -> None:
    sched = FairScheduler(capacity=1)
    calls = Calls(sched)
    await calls.start("x", "x")
    for name in ("a1", "a2", "a3"):
        await calls.start(name, "a")
    for name in ("b1", "b2"):
        await calls.start(name, "b")
    holder = "x"
    for _ in range(5):
        sched.release(holder)  # the one running call ends
        await settle()
        holder = calls.granted[-1][0]  # its session: "a" or "b"
    assert calls.granted == ["x", "a1", "b1", "a2", "b2", "a3"]


async def test_the_session_with_fewest_calls_running_gets_the_next_slot() -> None:
    """A hog holding the capacity with calls queued before the victim's: the first slot that
    frees is the victim's, not the hog's next."""
    sched = FairScheduler(capacity=3)
    calls = Calls(sched)
    for name in ("h1", "h2", "h3", "h4", "h5"):
        await calls.start(name, "hog")
    await calls.start("v1", "victim")
    assert calls.granted == ["h1", "h2", "h3"] and sched.waiting == 3
    sched.release("hog")
    await settle()
    assert calls.granted[-1] == "v1"
    sched.release("hog")
    await settle()
    assert calls.granted[-1] == "h4"


async def test_a_waiter_whose_client_left_leaves_the_queue() -> None:
    sched = FairScheduler(capacity=1)
    calls = Calls(sched)
    await calls.start("a1", "a")
    await calls.start("a2", "a")
    await calls.start("b1", "b")
    calls.tasks["a2"].cancel()
    await settle()
    assert calls.tasks["a2"].cancelled() and sched.waiting == 1 and sched.waiting_of("a") == 0
    sched.release("a")
    await settle()
    assert calls.granted == ["a1", "b1"] and sched.in_flight == 1


async def test_a_waiter_cancelled_after_its_grant_hands_the_slot_on() -> None:
    """Granted, then cancelled before it ran: the slot is not lost, the next waiter has it."""
    sched = FairScheduler(capacity=1)
    calls = Calls(sched)
    await calls.start("a1", "a")
    await calls.start("b1", "b")
    await calls.start("c1", "c")
    sched.release("a")  # grants b1's future; b1's task has not resumed yet
    calls.tasks["b1"].cancel()
    await settle()
    assert calls.tasks["b1"].cancelled()
    assert calls.granted == ["a1", "c1"] and sched.in_flight == 1 and sched.waiting == 0
    assert sched.running_of("b") == 0 and sched.running_of("c") == 1


async def test_a_waiter_cancelled_before_a_release_is_skipped_by_it() -> None:
    """Cancelled (its future too) but its cleanup not run yet when a slot frees: the slot goes
    to the next waiter, never to the cancelled one."""
    sched = FairScheduler(capacity=1)
    calls = Calls(sched)
    await calls.start("a1", "a")
    await calls.start("b1", "b")
    await calls.start("b2", "b")
    calls.tasks["b1"].cancel()
    sched.release("a")
    await settle()
    assert calls.granted == ["a1", "b2"] and sched.in_flight == 1 and sched.waiting == 0


async def test_no_slot_is_lost_when_calls_fail() -> None:
    sched = FairScheduler(capacity=2, per_session=2)

    async def failing(session: str) -> None:
        await sched.acquire(session)
        try:
            await asyncio.sleep(0)
            raise RuntimeError("the policy broke")
        finally:
            sched.release(session)

    results = await asyncio.gather(*(failing(s) for s in "aaabbbc"), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert sched.in_flight == 0 and sched.waiting == 0
    assert sched.summary()["sessions_waiting"] == 0
    sched.release("a")  # a release with nothing held frees nothing
    assert sched.in_flight == 0


async def test_queues_are_bounded_overall_and_per_session() -> None:
    sched = FairScheduler(capacity=1, max_waiting=2, max_waiting_per_session=1)
    calls = Calls(sched)
    await calls.start("a1", "a")
    await calls.start("a2", "a")
    with pytest.raises(QueueFull, match="of this session"):
        await sched.acquire("a")
    await calls.start("b1", "b")
    with pytest.raises(QueueFull, match="2 calls are waiting"):
        await sched.acquire("c")
    assert sched.waiting == 2


async def test_force_takes_a_slot_past_every_bound() -> None:
    sched = FairScheduler(capacity=1, per_session=1)
    await sched.acquire("a")
    await asyncio.wait_for(sched.acquire("a", force=True), 1)
    assert sched.in_flight == 2 and sched.running_of("a") == 2


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="0 \\(unbounded\\) or more"):
        FairScheduler(capacity=-1)


class FakeClient:
    def __init__(self, url: str) -> None:
        self.base_url = url


def one_server(**kw: Any) -> ReplicaSet:
    return ReplicaSet(["http://r0"], FakeClient, **kw)  # type: ignore[arg-type]


async def test_a_generation_refused_by_its_server_gives_its_session_turn_back() -> None:
    reps = one_server(max_in_flight=1, max_queue=0)
    replica = reps.replicas["http://r0"]
    sessions = FairScheduler(per_session=4)
    first = Generation(reps, "s", replica, sessions)
    await first.acquire()
    with pytest.raises(ReplicasBusy, match="agenttap_replica_queue"):
        await Generation(reps, "s", replica, sessions).acquire()
    assert sessions.running_of("s") == 1 and replica.in_flight == 1
    await first.release()
    await first.release()  # twice: nothing more freed
    assert sessions.running_of("s") == 0 and replica.in_flight == 0


async def test_a_session_past_its_bound_waits_before_its_server_and_a_full_queue_is_busy() -> None:
    reps = one_server(max_in_flight=0, max_queue=1)
    replica = reps.replicas["http://r0"]
    sessions = FairScheduler(per_session=1, max_waiting_per_session=1)
    held = Generation(reps, "hog", replica, sessions)
    await held.acquire()
    waiting = asyncio.create_task(Generation(reps, "hog", replica, sessions).acquire())
    await settle()
    assert not waiting.done() and sessions.waiting_of("hog") == 1 and replica.in_flight == 1
    with pytest.raises(ReplicasBusy, match="agenttap_session_max_inflight"):
        await Generation(reps, "hog", replica, sessions).acquire()
    other = Generation(reps, "victim", replica, sessions)
    await asyncio.wait_for(other.acquire(), 1)
    await held.release()
    await asyncio.wait_for(waiting, 1)
    assert replica.in_flight == 2 and sessions.running_of("hog") == 1


async def test_a_server_saturated_by_a_hog_serves_the_victim_next() -> None:
    """Through ReplicaSet: the server's waiting counts mirror the scheduler's, and the victim
    queued after the hog's calls is granted first."""
    reps = one_server(max_in_flight=2, max_queue=8)
    replica = reps.replicas["http://r0"]
    order: list[str] = []

    async def call(session: str, name: str) -> None:
        await reps.acquire(replica, session)
        order.append(name)

    tasks = [asyncio.create_task(call("hog", f"h{i}")) for i in range(4)]
    await settle()
    tasks.append(asyncio.create_task(call("victim", "v")))
    await settle()
    assert order == ["h0", "h1"] and replica.waiting == 3
    await reps.release(replica, "hog")
    await settle()
    assert order[-1] == "v" and replica.waiting == 2 and replica.in_flight == 2
    for t in tasks:
        t.cancel()
    await settle()
    assert replica.waiting == 0


@pytest.mark.parametrize("bad", ["-1", "eight", "2.5", ""])
def test_the_session_bound_option_takes_a_whole_number(bad: str) -> None:
    from capture.options import parse_settings

    assert parse_settings({}).session_max_inflight == 8
    assert parse_settings({"agenttap_session_max_inflight": "0"}).session_max_inflight == 0
    with pytest.raises(ValueError, match="agenttap_session_max_inflight"):
        parse_settings({"agenttap_session_max_inflight": bad})
