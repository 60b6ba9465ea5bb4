import pytest

from rig import RankFailure

# The rig is safe_zero's own code, the same on every DeepSpeed release.
pytestmark = pytest.mark.main_leg_only


def _rank_and_sum():
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return "fine"


def _die_on_rank_one():
    import os
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits for the dead rank: only the pool's liveness check ends the job


def _raise_on_rank_one_while_rank_zero_waits():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # never joined by rank 1


def test_two_ranks_share_a_gloo_group(ranks):
    assert ranks.run(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)]


def test_a_failing_rank_is_reported_with_its_error(ranks):
    with pytest.raises(RankFailure, match="rank 1: ValueError: boom on rank 1"):
        ranks.run(2, _raise_on_rank_one)


def test_a_job_a_rank_left_ends_after_the_grace_not_the_timeout(ranks):
    import time

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"finished: \[1\]\); rank 1: ValueError: boom on rank 1"):
        ranks.run(2, _raise_on_rank_one_while_rank_zero_waits, timeout=120, grace=1)
    assert time.monotonic() - start < 30
    assert ranks.run(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)], "the next job gets a fresh pool"


def test_a_dying_rank_is_reported_with_its_exit_code(ranks):
    with pytest.raises(RuntimeError, match=r"pool died during job \d+ \(exit codes by rank: \{.*1: -9"):
        ranks.run(2, _die_on_rank_one)
    assert ranks.run(2, _rank_and_sum) == [(0, 3.0), (1, 3.0)], "the next job gets a fresh pool"


def test_closing_a_pool_releases_the_shm_workspaces_deepspeed_leaves():
    from safe_zero.probes import deepspeed_shm_segments
    from rig import DistPool

    pool = DistPool(2)
    try:
        # DeepSpeed's CPU comm op made one ~66 MB /dev/shm segment per rank and will never unlink them.
        assert len(deepspeed_shm_segments(pool._port)) == 2
    finally:
        pool.close()
    assert deepspeed_shm_segments(pool._port) == set()
