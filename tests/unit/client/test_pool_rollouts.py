"""A Ray pool's group placement (capture/client/pool_rollouts.py): pure functions, no Ray."""

from __future__ import annotations

import pytest

from capture.client.pool_rollouts import Capacity, GroupRun, PlacementError, place, shares


def caps(*nodes: tuple[str, int, int, str]) -> list[Capacity]:
    """One actor per (node, budget MiB, held MiB, engine)."""
    return [Capacity(i, node, budget, held, 0, engine) for i, (node, budget, held, engine) in
            enumerate(nodes)]  # fmt: skip


def test_a_group_is_spread_over_nodes_by_free_memory() -> None:
    chosen = place(caps(("a", 4000, 0, ""), ("b", 4000, 0, "")), 8, 500, needs_engine=False)
    assert chosen.count(0) == chosen.count(1) == 4
    # A node with less free takes fewer: 3000 free vs 1000 free, 500 each.
    chosen = place(caps(("a", 4000, 1000, ""), ("b", 4000, 3000, "")), 8, 500, False)
    assert (chosen.count(0), chosen.count(1)) == (6, 2)


def test_no_node_is_given_more_than_fits_while_another_has_room() -> None:
    # 3 fit on a, 5 on b: every one of the 8 fits somewhere, so none goes over.
    chosen = place(caps(("a", 1500, 0, ""), ("b", 2500, 0, "")), 8, 500, False)
    assert (chosen.count(0), chosen.count(1)) == (3, 5)


def test_actors_on_one_node_share_its_memory() -> None:
    # Two actors on node a (budget 2000, each reporting it) and one on b (2000): a's actors
    # together take no more than b's one.
    chosen = place(caps(("a", 2000, 0, ""), ("a", 2000, 0, ""), ("b", 2000, 0, "")), 8, 500, False)
    assert chosen.count(0) + chosen.count(1) == chosen.count(2) == 4
    assert chosen.count(0) == chosen.count(1) == 2


def test_an_image_rollout_never_goes_to_a_node_without_an_engine() -> None:
    pool = caps(("a", 8000, 0, ""), ("b", 1000, 0, "/usr/bin/podman"))
    assert set(place(pool, 6, 500, needs_engine=True)) == {1}
    assert set(place(pool, 6, 500, needs_engine=False)) == {0}  # the most free
    with pytest.raises(PlacementError, match="container engine"):
        place(caps(("a", 8000, 0, "")), 1, 500, needs_engine=True)


def test_a_warm_image_is_preferred_and_too_large_a_need_is_refused() -> None:
    pool = caps(("a", 8000, 0, "podman"), ("b", 8000, 0, "podman"))
    pool[1].image_warm = True
    assert place(pool, 2, 500, True) == [1, 1]
    with pytest.raises(PlacementError, match="9000 MiB"):
        place(pool, 1, 9000, False)
    with pytest.raises(PlacementError, match="no actor"):
        place([], 1, 10, False)


def test_shares_are_consecutive_numbers_per_actor() -> None:
    assert shares([0, 1, 2, 3, 4], [1, 0, 1, 0, 1]) == [(0, [0, 1]), (1, [2, 3, 4])]
    # A retry's numbers with a gap: one share per consecutive run.
    assert shares([1, 2, 5], [3, 3, 3]) == [(3, [1, 2]), (3, [5])]


def test_a_groups_answer_lists_its_rollouts_in_order_with_their_nodes() -> None:
    group = GroupRun("g", "codex", 3, retries=0)
    for i, node in ((2, "n2"), (0, "n1"), (1, "n1")):
        group.runs[i] = {"index": i, "node": node}
    answer = group.summary()
    assert [r["index"] for r in answer["rollouts"]] == [0, 1, 2]
    assert answer["nodes"] == {"n1": 2, "n2": 1} and answer["status"] == "running"
    group.done.set()
    assert group.summary()["status"] == "done"
