"""capture/heap.py: the start-up heap frozen, young collections rarer, cycles still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from capture.heap import YOUNG_THRESHOLD, settle_heap


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """The collector as it was before the test (the rest of the suite runs with defaults)."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_settling_freezes_what_lives_and_raises_the_young_threshold(restored_gc: None) -> None:
    kept = [Node() for _ in range(100)]
    _, middle, old = gc.get_threshold()
    frozen = settle_heap()
    # Frozen objects still die by reference counting (any thread may drop one), so the count
    # can only fall after settling.
    assert len(kept) < frozen
    assert 0 < gc.get_freeze_count() <= frozen
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old)
    # What was alive at settling is out of the collector's sight from then on.
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(node) in tracked for node in kept)


def test_cycles_made_after_settling_are_still_collected(restored_gc: None) -> None:
    settle_heap()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: reference counting alone never frees it
    gone = weakref.ref(a)
    del a, b
    assert gone() is not None
    gc.collect()
    assert gone() is None


def test_a_young_threshold_below_one_is_refused(restored_gc: None) -> None:
    before = gc.get_threshold()
    with pytest.raises(ValueError, match="young_threshold must be 1 or more"):
        settle_heap(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
