"""Replays of :mod:`safe_zero.rank_progress` in one process: each rank is a thread over one torch ``HashStore``, and
posts, leaves and meets as its engine would. The real-rank runs are in ``tests/test_uneven_inputs.py``."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
from torch.distributed import HashStore

from safe_zero.rank_progress import RankProgress, UnevenInputsError
from tests.support.threads import on_threads


class CountingStore(HashStore):
    """A ``HashStore`` that counts the operations each thread makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def set(self, key: str, value: Any) -> None:
        self.calls.append("set")
        super().set(key, value)

    def add(self, key: str, value: int) -> int:
        self.calls.append("add")
        return super().add(key, value)


def progress(store: Any, world: int, timeout: float = 10.0, slots: int = 3) -> list[RankProgress]:
    return [RankProgress(store, rank, world, "engine0", slots=slots, timeout=timeout) for rank in range(world)]


def steps(rank: RankProgress, count: int, then: Callable[[], Any]) -> Callable[[], Any]:
    """A rank that begins ``count`` micro-steps (each posted by a forward and its backward), then ``then``."""
    def run() -> Any:
        for m in range(count):
            rank.begin(m)
            rank.begin(m)
        return then()
    return run


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_ran_the_same_micro_steps_meet_again_and_again(world):
    ranks = progress(HashStore(), world, slots=3)  # 20 micro-steps go round the ring of 3 slots
    assert on_threads(*(steps(r, 20, lambda r=r: (r.meet(20, "save"), r.meet(20, "save"))) for r in ranks)) == (
        [(None, None)] * world)


def test_a_micro_step_costs_one_set_and_nothing_is_waited_for():
    store = CountingStore()
    rank = progress(store, 2)[0]
    for m in range(5):
        for _ in range(3):  # a forward and a backward, or several forwards: one post
            rank.begin(m)
    assert store.calls == ["set"] * 5


@pytest.mark.parametrize("late", [False, True])
def test_a_rank_that_saves_while_another_began_a_later_micro_step_raises(late):
    """Rank 1 ran out after 3 micro-steps and saves; ranks 0 and 2 begin their 4th (and would wait in its first
    collective): posted before rank 1 arrives, or while it waits."""
    ranks = progress(HashStore(), 3)

    def going_on(rank: RankProgress) -> Callable[[], Any]:
        def run() -> None:
            for m in range(3):
                rank.begin(m)
            if late:
                time.sleep(0.2)
            rank.begin(3)
        return run

    results = on_threads(going_on(ranks[0]), steps(ranks[1], 3, lambda: ranks[1].meet(3, "save_checkpoint")),
                         going_on(ranks[2]))
    assert isinstance(results[1], UnevenInputsError)
    assert "rank 1 reached save_checkpoint after micro-step 3 while another rank began micro-step 4" in str(results[1])
    assert "Join([engine])" in str(results[1])


def test_ranks_that_save_after_different_micro_steps_all_raise():
    """ZeRO-1 with gradient accumulation: rank 0 runs a 4th micro-step (no collective before the boundary) and
    saves; rank 1 saves after 3."""
    ranks = progress(HashStore(), 2, slots=4)
    results = on_threads(steps(ranks[0], 4, lambda: ranks[0].meet(4, "save_checkpoint")),
                         steps(ranks[1], 3, lambda: ranks[1].meet(3, "save_checkpoint")))
    assert all(isinstance(r, UnevenInputsError) for r in results), results
    assert "different numbers of micro-steps (rank 0: 4, rank 1: 3)" in str(results[0])
    assert "began micro-step 4" in str(results[1])


def test_a_rank_that_never_comes_is_named_after_the_timeout():
    ranks = progress(HashStore(), 3, timeout=0.3)
    started = time.monotonic()
    results = on_threads(lambda: ranks[0].meet(0, "save_checkpoint"), lambda: ranks[1].meet(0, "save_checkpoint"),
                         lambda: None)
    assert time.monotonic() - started < 5
    assert all(isinstance(r, UnevenInputsError) for r in results[:2])
    assert "waited 0 s at save_checkpoint after micro-step 0 for rank(s) 2," in str(results[0])


def test_a_rank_that_comes_late_is_waited_for():
    ranks = progress(HashStore(), 2, timeout=10)

    def late() -> None:
        time.sleep(0.5)
        ranks[1].meet(2, "save_checkpoint")

    assert on_threads(steps(ranks[0], 2, lambda: ranks[0].meet(2, "save_checkpoint")), steps(ranks[1], 2, late)) == (
        [None, None])


def test_a_forward_every_rank_ran_without_stepping_is_no_later_micro_step():
    """Each rank began micro-step 3 (a forward in training mode, no backward) and saves after 2: its own post cannot
    be told from the others', so the counts decide, and they agree."""
    ranks = progress(HashStore(), 2)
    assert on_threads(*(steps(r, 3, lambda r=r: r.meet(2, "save_checkpoint")) for r in ranks)) == [None, None]


def test_destroy_raises_if_a_rank_went_on_and_otherwise_does_not_wait():
    ranks = progress(HashStore(), 3)
    for rank, count in zip(ranks, (3, 2, 1)):
        for m in range(count):
            rank.begin(m)
    ranks[0].leave(3, "the engine's destroy")  # no rank began micro-step 4: nothing to see, and no wait for them
    with pytest.raises(UnevenInputsError, match="rank 2 reached the engine's destroy after micro-step 1 while another "
                                                "rank began micro-step 2"):
        ranks[2].leave(1, "the engine's destroy")
