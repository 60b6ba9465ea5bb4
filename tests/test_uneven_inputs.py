"""Uneven inputs under ``torch.distributed.algorithms.Join`` (safe_zero/uneven_inputs.py): each rank runs its own
number of batches; the parameters after training equal single-process AdamW on the samples the ranks saw, averaged
as DDP's ``divide_by_initial_world_size`` says. Stock DeepSpeed's engine is no ``Joinable``, and without ``Join``
the ranks' collectives stop pairing up at the first batch a finished rank does not run."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch
from torch import nn

from rig import RankFailure
from tests.support.collective_mismatch import MISMATCH, main_stack
from tests.support.models import OptionalTower, build
from tests.support.uneven_inputs import LR, TOLERANCE, Regression, config, max_error


def batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)


def _train(counts: list[int], stage: int, world_size: int, accumulation: int = 1, dtype: str = "fp32",
           divide: bool | None = None, checkpoint: str | None = None) -> dict:
    """Rank ``r`` runs ``counts[r]`` micro-batches, each ``engine(x, y)``, ``backward``, ``step``; inside ``Join``
    unless ``divide`` is None. Rank 0 returns the full fp32 parameters after the Join (and after a checkpoint round
    trip into a fresh engine, with ``checkpoint``)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join

    import safe_zero

    rank = dist.get_rank()
    engine, *_ = safe_zero.initialize(model=build(Regression), config=config(stage, world_size, accumulation, dtype))
    boundaries = []
    with Join([engine], divide_by_initial_world_size=divide) if divide is not None else _nothing():
        for i in range(counts[rank]):
            x, y = batch(rank, i)
            loss = engine(x.to(engine.module.a.weight.dtype), y.to(engine.module.a.weight.dtype))
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.backward(loss)
            engine.step()
    steps = engine.global_steps
    # After the Join an iteration joins nothing: a no-grad forward on one rank (an evaluation) makes no collective.
    joined_after = engine._join_config.enable
    if divide is not None and stage < 3 and rank == 0:
        with torch.no_grad():
            engine(*(t.to(engine.module.a.weight.dtype) for t in batch(rank, 0)))
    if checkpoint:
        engine.save_checkpoint(checkpoint, tag="joined")
        engine, *_ = safe_zero.initialize(model=build(Regression, seed=1),
                                          config=config(stage, world_size, accumulation, dtype))
        engine.load_checkpoint(checkpoint, tag="joined")
    return {"params": _rank0_params(engine), "steps": steps, "boundaries": boundaries, "joined_after": joined_after}


def _rank0_params(engine: Any) -> dict:
    """Rank 0's full fp32 parameters (gathered under ZeRO-3; ``{}`` elsewhere); then the engine is destroyed."""
    import deepspeed
    import torch.distributed as dist

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=engine.zero_optimization_partition_weights()):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()} if (
            dist.get_rank() == 0) else {}
    engine.destroy()
    return params


def _failed_run(pool: Any, fn: Callable, expected: tuple[type[BaseException], ...] = (RankFailure, RuntimeError,
                                                                                    TimeoutError),
                **kwargs: Any) -> BaseException:
    """``pool.run(fn, **kwargs)``, which must fail with one of ``expected``: its error, once the rig has ended what was
    left of the pool (its ranks wait in collectives that never end), so the next test gets a fresh one."""
    with pytest.raises(expected) as failure:
        pool.run(fn, **kwargs)
    deadline = time.monotonic() + 30
    while pool.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return failure.value


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def reference(counts: list[int], world_size: int, accumulation: int = 1, divide: bool = True) -> dict:
    """Single-process fp32 AdamW + clipping: micro-step ``m`` averages the losses of the ranks with an ``m``-th batch
    over the world size (``divide``) or over those ranks; a step every ``accumulation`` micro-steps."""
    return reference_phases([counts], world_size, accumulation, divide)


def reference_phases(phases: list[list[int]], world_size: int, accumulation: int = 1, divide: bool = True,
                     model: type[nn.Module] = Regression, batch_of: Callable[[int, int], tuple] = batch) -> dict:
    """:func:`reference` over consecutive Joins, each with its own per-rank counts; each rank's batches number on
    across them (``batch_of(rank, i)``: the ``i``-th batch of ``rank``, for ``model``)."""
    net = build(model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    seen, micro_step = [0] * world_size, 0
    for counts in phases:
        for m in range(max(counts)):  # a last window cut short steps nothing, as on DeepSpeed
            active = [r for r in range(world_size) if m < counts[r]]
            if active:
                losses = torch.stack([net(*batch_of(r, seen[r] + m)) for r in active])
                (losses.sum() / (world_size if divide else len(active)) / accumulation).backward()
            micro_step += 1
            if micro_step % accumulation == 0:
                for p in net.parameters():  # ZeRO steps whole flat groups: what no rank used gets a zero gradient
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        seen = [s + c for s, c in zip(seen, counts)]
    return {n: p.detach().clone() for n, p in net.named_parameters()}


#: Per rank, how many micro-batches it has: one rank with none after the first step, and three different counts.
UNEVEN = {2: [[5, 1], [2, 4]], 3: [[4, 1, 3], [1, 5, 2]]}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ranks_with_uneven_batches_train_as_ddp_under_join(ranks, stage, world_size):
    for counts in UNEVEN[world_size]:
        results = ranks.run(world_size, _train, timeout=90, counts=counts, stage=stage, world_size=world_size,
                            divide=True)
        assert max_error(results[0]["params"], reference(counts, world_size)) < TOLERANCE, counts
        assert {r["steps"] for r in results} == {max(counts)}, "every rank steps the others' steps"
        assert not any(r["joined_after"] for r in results)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_divide_by_the_ranks_that_had_a_batch(ranks, stage):
    counts = [5, 2]
    results = ranks.run(2, _train, timeout=90, counts=counts, stage=stage, world_size=2, divide=False)
    assert max_error(results[0]["params"], reference(counts, 2, divide=False)) < TOLERANCE
    assert max_error(results[0]["params"], reference(counts, 2, divide=True)) > 10 * TOLERANCE, "the choice shows"


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_boundaries_stay_the_same_on_every_rank(ranks, stage):
    counts = [8, 3]  # rank 1 stops inside its second window: its shadow of the 4th micro-step closes it
    results = ranks.run(2, _train, timeout=90, counts=counts, stage=stage, world_size=2, accumulation=2, divide=True)
    assert max_error(results[0]["params"], reference(counts, 2, accumulation=2)) < TOLERANCE
    assert results[1]["boundaries"] == [False, True, False]
    assert {r["steps"] for r in results} == {4}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_ranks_with_uneven_batches_train_within_the_bf16_band(ranks, stage):
    counts = [4, 1]
    results = ranks.run(2, _train, timeout=90, counts=counts, stage=stage, world_size=2, dtype="bf16", divide=True)
    assert max_error(results[0]["params"], reference(counts, 2)) < 2e-2


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_saved_after_the_join_resumes(ranks, tmp_path, stage):
    counts = [4, 1]
    trained = ranks.run(2, _train, timeout=90, counts=counts, stage=stage, world_size=2, divide=True)[0]["params"]
    resumed = ranks.run(2, _train, timeout=90, counts=counts, stage=stage, world_size=2, divide=True,
                        checkpoint=str(tmp_path / "ckpt"))[0]["params"]
    assert all(torch.equal(trained[n], resumed[n]) for n in trained)


@pytest.mark.parametrize("stage", [2, 3])
def test_rl_phases_each_in_its_own_join_with_a_rank_that_has_nothing_in_one(ranks, stage):
    """An RL loop: each rollout keeps its own number of samples per rank, trained in a Join of its own; in the second
    phase rank 1 kept none (at ZeRO-3 it runs its last micro-batch of the first phase again, times zero)."""
    phases = [[2, 1], [2, 0], [1, 3]]
    results = ranks.run(2, _train_phases, timeout=90, phases=phases, stage=stage)
    assert max_error(results[0], reference_phases(phases, 2)) < TOLERANCE


def _train_phases(phases: list[list[int]], stage: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join

    import safe_zero

    rank, seen = dist.get_rank(), 0
    engine, *_ = safe_zero.initialize(model=build(Regression), config=config(stage, 2, 1, "fp32"))
    for counts in phases:
        with Join([engine]):
            for i in range(seen, seen + counts[rank]):
                engine.backward(engine(*batch(rank, i)))
                engine.step()
        seen += counts[rank]
    return _rank0_params(engine)


def image_or_text(rank: int, i: int) -> tuple:
    """Rank 0's samples carry an image, the others' are text only: ``OptionalTower``'s tower runs on rank 0 alone."""
    x, y = batch(rank, i)
    return x, y, torch.randn(2, 4, generator=torch.Generator().manual_seed(7000 + i)) if rank == 0 else None


@pytest.mark.parametrize("counts", [[3, 1], [1, 3]])
def test_a_vision_language_model_with_image_and_text_ranks_joins_at_zero3(ranks, counts):
    """ZeRO-3, mixed image/text ranks, no configuration: the first step finds the tower (kept gathered from then on),
    so the finished rank's rerun of its last batch, image or text, makes the gathers of the other's batches."""
    results = ranks.run(2, _train_tower, timeout=90, counts=counts)
    assert max_error(results[0], reference_phases([counts], 2, model=OptionalTower, batch_of=image_or_text)) < (
        TOLERANCE)


def _train_tower(counts: list[int]) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.join import Join

    import safe_zero

    rank = dist.get_rank()
    engine, *_ = safe_zero.initialize(model=build(OptionalTower), config=config(3, 2, 1, "fp32"))
    with Join([engine]):
        for i in range(counts[rank]):
            engine.backward(engine(*image_or_text(rank, i)))
            engine.step()
    return _rank0_params(engine)


def test_the_engine_is_a_joinable_and_stock_deepspeeds_is_not(ranks):
    results = ranks.run(1, _is_joinable)
    assert results[0] == {"safe_zero": True, "stock": False}


def _is_joinable() -> dict:
    import deepspeed
    from torch.distributed.algorithms.join import Joinable

    import safe_zero

    found = {}
    for name, init in (("safe_zero", safe_zero.initialize), ("stock", deepspeed.initialize)):
        engine, *_ = init(model=build(Regression), config=config(2, 1, 1, "fp32"))
        found[name] = isinstance(engine, Joinable)
        engine.destroy()
    return found


def test_stock_deepspeed_fails_on_uneven_batches(ranks):
    """Stock DeepSpeed (no Join), ZeRO-3: rank 1 runs one batch and its process ends, as a finished job's does; rank 0
    goes on into its second step's gathers and reductions, which gloo ends with the peer gone (NCCL waits for good)."""
    pool = ranks(2)
    text = str(_failed_run(pool, _train_stock_uneven, timeout=60, grace=5))
    assert MISMATCH.search(text) or "died during job" in text, text[:2000]


def _train_stock_uneven() -> None:
    import os

    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    # ZeRO-3: stock ZeRO-1/2 on DeepSpeed 0.18.7-0.18.x fails a step before, on its own defect (flat_buffer_autograd).
    engine, *_ = deepspeed.initialize(model=build(Regression), config=config(3, 2, 1, "fp32"))
    for i in range(3 if rank == 0 else 1):
        loss = engine(*batch(rank, i))
        engine.backward(loss)
        engine.step()
    if rank == 1:
        time.sleep(1)
        os._exit(0)  # rank 1 is done; rank 0 is still stepping


#: What these check is safe_zero's own, the same on every release, and each ends its pool: the legacy leg runs the
#: ZeRO-1 case only.
_LATER = pytest.mark.main_leg_only


@pytest.mark.parametrize(("stage", "world_size", "where"), [
    (1, 2, "save_checkpoint"), pytest.param(2, 2, "destroy", marks=_LATER),
    pytest.param(3, 3, "save_checkpoint", marks=_LATER), pytest.param(3, 2, "16-bit state dict", marks=_LATER)])
def test_a_rank_that_leaves_while_the_others_step_raises_instead_of_hanging(ranks, tmp_path, stage, world_size, where):
    """No Join: rank 1 runs one batch and saves (or destroys its engine) while the others begin their second micro-step
    and wait in its first collective. Rank 1 raises, naming the micro-steps and Join; the others wait in gloo until
    the job ends, as a launcher ends one whose rank failed."""
    counts = [3, 1, 2][:world_size]
    pool = ranks(world_size)
    text = str(_failed_run(pool, _leave_early, expected=(RankFailure, TimeoutError), timeout=60, grace=3,
                           counts=counts, stage=stage, where=where, path=str(tmp_path)))
    named = {"16-bit state dict": "the ZeRO-3 16-bit state dict", "destroy": "the engine's destroy"}.get(where, where)
    assert f"rank 1 reached {named}" in text, text[:3000]
    assert "after micro-step 1 while another rank began micro-step 2" in text
    assert "UnevenInputsError" in text and "Join([engine])" in text


@_LATER
def test_stock_deepspeed_hangs_where_a_rank_saves_while_the_others_step(ranks, tmp_path):
    """The same run on stock DeepSpeed (ZeRO-3, rank 1 saves after one batch): no rank says anything. Either gloo
    aborts on the mismatch, or both ranks still wait in a collective when the job times out: rank 1 in
    save_checkpoint's, rank 0 in its second step's (each rank's stack is dumped before the timeout)."""
    pool = ranks(2)
    error = _failed_run(pool, _leave_early, timeout=14, counts=[3, 1], stage=3, where="save_checkpoint",
                        path=str(tmp_path), stock=True, dump_after=9.0)
    text = str(error)
    assert "UnevenInputsError" not in text
    if isinstance(error, TimeoutError):
        assert "finished: []" in text, text
        stacks = {r: main_stack((tmp_path / f"stack{r}.txt").read_text()) for r in range(2)}
        for rank, stack in stacks.items():
            assert stack and stack[0].split(":")[0].endswith("torch/distributed/distributed_c10d.py"), (rank, stack)
        assert any(frame.endswith(":save_checkpoint") for frame in stacks[1]), stacks[1]
        assert not any(frame.endswith(":save_checkpoint") for frame in stacks[0]), stacks[0]
    else:
        assert MISMATCH.search(text) or "died during job" in text, text[:2000]


def _leave_early(counts: list[int], stage: int, where: str, path: str, stock: bool = False,
                 dump_after: float | None = None) -> None:
    import faulthandler
    import os

    import deepspeed
    import torch.distributed as dist

    import safe_zero

    rank = dist.get_rank()
    if dump_after is not None:  # a rank still here then writes where it waits
        faulthandler.dump_traceback_later(dump_after, file=open(os.path.join(path, f"stack{rank}.txt"), "w"))
    try:
        _run_and_leave(engine_of=deepspeed.initialize if stock else safe_zero.initialize, counts=counts, stage=stage,
                       where=where, path=path, rank=rank)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run_and_leave(engine_of: Callable, counts: list[int], stage: int, where: str, path: str, rank: int) -> None:
    engine, *_ = engine_of(model=build(Regression), config=config(stage, len(counts), 1, "fp32"))
    for i in range(counts[rank]):
        engine.backward(engine(*batch(rank, i)))
        engine.step()
    if where == "save_checkpoint":
        engine.save_checkpoint(path)
    elif where == "destroy":
        time.sleep(1)  # the finished rank's own work after its loop: the others have begun their next micro-step
        engine.destroy()
    else:  # what Accelerate's get_state_dict and save_16bit_model call under ZeRO-3
        engine._zero3_consolidated_16bit_state_dict()


@_LATER
def test_a_rank_that_comes_late_to_a_save_is_waited_for(ranks, tmp_path):
    results = ranks.run(2, _save_late, timeout=90, path=str(tmp_path / "ckpt"))
    assert results[0] == results[1] == 2


def _save_late(path: str) -> int:
    import torch.distributed as dist

    import safe_zero

    rank = dist.get_rank()
    engine, *_ = safe_zero.initialize(model=build(Regression), config=config(2, 2, 1, "fp32"))
    for i in range(2):
        engine.backward(engine(*batch(rank, i)))
        engine.step()
    time.sleep(2 * rank)
    engine.save_checkpoint(path, tag="late")
    _, client = engine.load_checkpoint(path, tag="late")
    steps = engine.global_steps
    engine.destroy()
    return steps
