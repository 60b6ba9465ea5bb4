"""``safe_zero.ranks``: the one ranks interface. On real gloo ranks, :class:`ProcessGroupRanks` names each engine once
in the store (the module order's meetings and the rank progress share it) and meets there; in one process,
:class:`ReplayWorld` makes the same collectives and fails where real ranks would hang."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as torch_dist

from safe_zero.ranks import Hang, ProcessGroupRanks, ReplayWorld
from safe_zero.session import Session
from tests.support.threads import on_threads


def _engines_and_meetings() -> dict[str, Any]:
    first, second = Session(), Session()
    rank = torch_dist.get_rank()
    prefix = first.ranks.prefix(None)
    return {
        "prefix": prefix,
        # the same engine asked again (the rank progress after the module order): its one name
        "again": first.ranks.prefix(torch_dist.group.WORLD),
        "second": second.ranks.prefix(None),
        "met": first.ranks.meet(None, "m0", 10 + rank, timeout=30),
        "gathered": first.ranks.all_gather(None, [rank, 300 + rank], bits=32),
        "reduced": first.ranks.all_reduce_min(None, [True, rank == 0]).result(),
        # rank 1 never posts under this key: rank 0's wait ends at its timeout, without a collective
        "alone": first.ranks.meet(None, "m1", rank, timeout=1) if rank == 0 else "absent",
    }


def test_each_engine_has_one_name_in_the_store_and_meets_there(ranks):
    results = ranks.run(2, _engines_and_meetings)
    assert results[0]["prefix"] == results[1]["prefix"] and results[0]["prefix"].startswith("safe_zero/")
    for r in results:
        assert r["again"] == r["prefix"] != r["second"]
        assert r["met"] == [10, 11]
        assert r["gathered"] == [[0, 300], [1, 301]]
        assert r["reduced"] == [1, 0]
    assert results[0]["alone"] is None


def test_a_process_group_ranks_object_is_what_a_session_makes():
    assert isinstance(Session().ranks, ProcessGroupRanks)


def test_replayed_ranks_gather_reduce_and_meet_as_real_ones():
    world = ReplayWorld(2)
    results = on_threads(*[lambda r=world.rank(rank): (r.all_gather(None, [r.rank], bits=8),
                                               r.all_reduce_min(None, [True, r.rank == 1]).result(),
                                               r.meet(None, "k", 5 + r.rank, timeout=1)) for rank in range(2)])
    assert results == [([[0], [1]], [1, 0], [5, 6])] * 2


@pytest.mark.parametrize("case", ["missing", "another kind", "another length"])
def test_a_replayed_rank_left_in_a_collective_hangs(case):
    world = ReplayWorld(2, timeout=0.5)
    other = {"missing": lambda r: None,
             "another kind": lambda r: r.all_reduce_min(None, [True]).result(),
             "another length": lambda r: r.all_gather(None, [1, 2])}[case]
    results = on_threads(lambda: world.rank(0).all_gather(None, [1]), lambda: other(world.rank(1)))
    assert isinstance(results[0], Hang)


def test_a_replayed_meeting_a_rank_misses_ends_at_its_timeout():
    world = ReplayWorld(2)
    assert on_threads(lambda: world.rank(0).meet(None, "k", 1, timeout=0.2), lambda: None)[0] is None


def test_a_replayed_row_must_fit_its_bits():
    with pytest.raises(AssertionError):
        ReplayWorld(1).rank(0).all_gather(None, [256], bits=8)
