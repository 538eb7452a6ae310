"""capture/logs/ratelimit.py: a failure that repeats is logged once per interval with a count."""

from __future__ import annotations

import logging

import pytest

from capture.logs.ratelimit import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_repeated_failure_is_one_line_per_interval_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("ratelog-test"), interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, "ratelog-test"):
        assert log.note("emfile", "accept failed") is True
        for _ in range(126_650):
            assert log.note("emfile", "accept failed") is False
        clock.now += 9.9
        assert log.note("emfile", "accept failed") is False
        clock.now += 0.2  # 10.1 s after the first line
        assert log.note("emfile", "accept failed") is True
    assert lines(caplog) == [
        "accept failed",
        "accept failed (126651 more like it in the last 10 s)",
    ]
    assert log.counts == {"emfile": 126_653}


def test_kinds_are_limited_apart_and_flush_tells_what_was_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("ratelog-test"), interval_s=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, "ratelog-test"):
        log.note("budget", "refused a")
        log.note("accept", "emfile")  # another kind: logged at once
        log.note("budget", "refused b")
        log.note("budget", "refused c")
        clock.now += 2
        log.flush()
        log.flush()  # nothing more held back: nothing more said
        clock.now += 1
        assert log.note("budget", "refused d") is False  # the flush counts as its last line
    assert lines(caplog) == [
        "refused a",
        "emfile",
        "refused c (2 more like it in the last 2 s)",
    ]
