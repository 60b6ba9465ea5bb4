"""The GPU checks: what CPU CI cannot test, each claim asserted stock-red and safe_zero-green on CUDA.

Run by ``python -m tests.gpu`` (``benchmarks/gpu_check.sh`` on a GPU machine), which exits 2 without CUDA and
writes a JSON report; skipped in the normal suite (marker ``gpu``). Each test runs its legs (``legs.py``) on a
pool of 1 or 2 NCCL ranks (``rig``), keeps every leg's records in the report (``record_property``) and
asserts that ``claims.py`` finds no problem with them. A 2-rank check needs 2 GPUs: NCCL refuses two ranks on one
device. The table in docs/gpu_checks.md names every test here without its ``test_`` prefix.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from rig import RankFailure
from tests.gpu import claims, legs

pytestmark = pytest.mark.gpu

#: Seconds a leg may take on every rank; once one rank has raised, the others get ``GRACE_S``.
LEG_TIMEOUT_S = 150
GRACE_S = 30
ONE_RANK_ROUTES = ["zero2", "bf16_optimizer", "zero3"]
TWO_RANK_ROUTES = ["zero3_all_reduce", "zero3"]
Legs = dict[str, tuple[Callable[..., dict], dict[str, Any]]]


def _need_gpus(world_size: int) -> None:
    import torch

    if torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size}-rank NCCL needs {world_size} GPUs (NCCL refuses two ranks on one device); this "
                    f"machine has {torch.cuda.device_count()}")


def _run(gpu_ranks: Any, world_size: int, specs: Legs, record_property: Any) -> tuple[dict[str, list], dict]:
    """Each leg of ``specs`` (name: body and its arguments) on every rank, in order: the records by leg name, and
    this installation's facts (rank 0's); both go into the report."""
    _need_gpus(world_size)
    pool = gpu_ranks(world_size)
    facts = pool.run(legs.facts)[0]
    record_property("facts", facts)
    got = {}
    for name, (body, kwargs) in specs.items():
        got[name] = pool.run(body, timeout=LEG_TIMEOUT_S, grace=GRACE_S, **kwargs)
        record_property(name, claims.summary(got[name]))
    return got, facts


def _grouped_mm_legs(routes: list[str]) -> Legs:
    specs: Legs = {"kernel": (legs.grouped_mm_kernel_probe, {})}
    for route in routes:
        specs[f"stock_{route}"] = (legs.grouped_mm_leg, {"route": route, "safe": False})
        specs[f"safe_{route}"] = (legs.grouped_mm_leg, {"route": route, "safe": True})
    return specs


def _holds(problems: list[str]) -> None:
    assert not problems, "\n".join(problems)


def test_grouped_mm_one_rank(gpu_ranks, record_property):
    """CUDA grouped_mm refuses a weight off the 16-byte grid; stock ZeRO-2, BF16_Optimizer (ZeRO-1 + bf16 + fp32 grad
    accumulation) and ZeRO-3 at one rank hand it one; safe_zero's layouts (DeepSpeed's parameter_alignment on
    ZeRO-1/2, its own order elsewhere) give grouped_mm aligned weights that train forward and backward."""
    got, facts = _run(gpu_ranks, 1, _grouped_mm_legs(ONE_RANK_ROUTES), record_property)
    _holds(claims.grouped_mm(got, facts, ONE_RANK_ROUTES))


def test_fp16_stage0_zero_sized(gpu_ranks, record_property, jit_op):
    """fp16 stage 0 (fused FP16_Optimizer with DeepSpeed's FusedAdam, and FP16_UnfusedOptimizer) with a zero-sized
    trainable parameter: stock fails exactly on the releases the fix table says (zero_element_groups, < 0.19.8) and
    safe_zero trains with the shape (0, 8) kept."""
    jit_op("fused_adam")
    specs: Legs = {f"{who}_{kind}": (legs.fp16_stage0_leg, {"fused": kind == "fused", "safe": who == "safe"})
                   for kind in ("fused", "unfused") for who in ("stock", "safe")}
    got, facts = _run(gpu_ranks, 1, specs, record_property)
    _holds(claims.fp16_stage0(got, facts))


def test_grouped_mm_fused_stage0(gpu_ranks, record_property, jit_op):
    """bf16 stage 0 with DeepSpeed's FusedAdam (fused FP16_Optimizer, which DeepSpeed never pads): stock hands CUDA
    grouped_mm a misaligned weight, safe_zero's order trains aligned."""
    jit_op("fused_adam")
    got, facts = _run(gpu_ranks, 1, _grouped_mm_legs(["fused_stage0"]), record_property)
    _holds(claims.grouped_mm(got, facts, ["fused_stage0"]))


def test_quantizer_one_rank(gpu_ranks, record_property, jit_op):
    """DeepSpeed's real CUDA quantizer kernel divides by zero on an empty partition and safe_zero's guard returns
    empty tensors (equal to stock on sized ones); zero_quantized_nontrainable_weights with a frozen zero-element
    layer: stock ZeroDivisionError, safe_zero trains."""
    jit_op("quantizer")
    specs: Legs = {"kernel": (legs.quantizer_kernel_leg, {}),
                   "stock_nontrainable": (legs.quantizer_leg, {"model": "nontrainable", "safe": False}),
                   "safe_nontrainable": (legs.quantizer_leg, {"model": "nontrainable", "safe": True})}
    got, facts = _run(gpu_ranks, 1, specs, record_property)
    _holds(claims.quantizer(got, facts, {"nontrainable": ("ZeroDivisionError",)}))


def test_grouped_mm_two_ranks(gpu_ranks, record_property):
    """At 2 NCCL ranks, stock ZeRO-3's stage3_use_all_reduce_for_fetch_params hands grouped_mm a misaligned weight and
    safe_zero's rounded slots do not; the default all-gather is aligned in stock already (why safe_zero keeps stock's
    layout at >= 2 ranks)."""
    got, facts = _run(gpu_ranks, 2, _grouped_mm_legs(TWO_RANK_ROUTES), record_property)
    _holds(claims.grouped_mm(got, facts, TWO_RANK_ROUTES, stock_aligned=("zero3",)))


def test_ddp_exact_two_ranks(gpu_ranks, record_property):
    """On NCCL, ZeRO-3 with a zero-element parameter in a mixed gather bucket and experts each rank uses differently:
    stock stops (torch.cat([]); 'Detected a disagreement'), safe_zero equals single-process fp32 AdamW on the global
    batch within 1e-5 (DDP's answer)."""
    specs: Legs = {"stock_mixed_moe": (legs.ddp_leg, {"model": "mixed_moe", "safe": False}),
                   "safe_mixed_moe": (legs.ddp_leg, {"model": "mixed_moe", "safe": True})}
    got, facts = _run(gpu_ranks, 2, specs, record_property)
    # Last: stock stops on one rank and leaves the other in a collective, which ends the pool's job after its grace.
    moe_error = None
    try:
        got["stock_moe"] = gpu_ranks(2).run(legs.ddp_leg, model="moe", safe=False, raising=True,
                                            timeout=LEG_TIMEOUT_S, grace=GRACE_S)
    except (RankFailure, TimeoutError) as e:
        got["stock_moe"], moe_error = [], str(e)
    record_property("stock_moe", claims.summary(got["stock_moe"]) or moe_error)
    _holds(claims.ddp_exact(got, facts, moe_error))


def test_quantizer_two_ranks(gpu_ranks, record_property, jit_op):
    """At 2 NCCL ranks, where DeepSpeed quantizes gathers: zero_quantized_nontrainable_weights (stock
    ZeroDivisionError) and zero_quantized_weights with a zero-element parameter in a mixed bucket (stock
    torch.cat([]) after the real quantized all-gather); safe_zero trains both with quantized gathers."""
    _need_gpus(2)
    jit_op("quantizer")
    specs: Legs = {f"{who}_{model}": (legs.quantizer_leg, {"model": model, "safe": who == "safe"})
                   for model in ("nontrainable", "weights") for who in ("stock", "safe")}
    got, facts = _run(gpu_ranks, 2, specs, record_property)
    _holds(claims.quantizer(got, facts, {"nontrainable": ("ZeroDivisionError",),
                                         "weights": (claims.EMPTY_CAT, claims.NOT_AVAILABLE, "ZeroDivisionError")}))
