"""Zero-element trainable parameters in the flattening wrappers.

On DeepSpeed < 0.19.8 the fp16/bf16/ZeRO-1/2 wrappers take a zero-element parameter into
their flat groups. Three symptoms, each asserted here on the leg that has it:
- 0.18.9 ZeRO-1/2: ``KeyError`` in ``average_tensor`` on the first backward;
- 0.18.9 ZeRO-1/2 with a placeholder inside a partition (FP-Quant's layout): ``fragment start N
  should be < fragment_end N`` at initialize;
- with a torch whose ``unflatten_dense_tensors`` returns ``zeros({0})`` for a zero-element tensor
  (torch <= 2.9; 2.13 keeps the shape, so it is emulated): the parameter is rebound as ``(0,)``.
DeepSpeed 0.19.8 keeps such parameters out of every group, so there stock passes and
  the fix stays off: the tests assert that too.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
from packaging.specifiers import SpecifierSet

from rig import RankFailure
from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import flat_buffer_autograd, zero_element_groups
from tests.support.bodies import (FRAGMENT_ASSERT, UNFLATTEN_LOSES_EMPTY_SHAPE, check_trained_and_restored,
                                  train_and_roundtrip)
from tests.support.models import ZeroSized, build, cpu_fused_adam, ds_config, train

NEEDED = zero_element_groups.FIX.needed(DEEPSPEED_VERSION)
# Stock's symptoms went away release by release (#8280/#8298 in 0.19.6, #8277 in 0.19.7, the rest in
# 0.19.8); what stock does is asserted per symptom, so ``make matrix`` checks every release exactly.
KEYERROR = DEEPSPEED_VERSION in SpecifierSet("<0.19.6")
SHAPE_LOST = {"FP16_Optimizer": NEEDED, "BF16_Optimizer": NEEDED,
              "DeepSpeedZeroOptimizer": DEEPSPEED_VERSION in SpecifierSet("<0.19.7")}
# Before 0.18.5 the engine's own (non-ZeRO) gradient all-reduce also sends a zero-element gradient
# through unflatten and copies the result back: under the emulation that raises in DeepSpeedEngine,
# which the injection does not reach (torch 2.13 keeps the shape, so real runs are unaffected).
ENGINE_REDUCES_ZERO_ELEMENT_GRADS = DEEPSPEED_VERSION in SpecifierSet("<0.18.5")


# --- zero-sized trainable parameter in ZeRO-1/2 gradient reduction --------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_stock_zero12_with_a_zero_sized_parameter(ranks, tmp_path, stage, world_size):
    run = dict(model="ZeroSized", stage=stage, safe=False, world_size=world_size, ckpt_dir=str(tmp_path))
    if UNFLATTEN_LOSES_EMPTY_SHAPE and SHAPE_LOST["DeepSpeedZeroOptimizer"]:
        # The parameter rebound as (0,) stops the first forward, before a backward reaches average_tensor.
        with pytest.raises(RankFailure, match=r"size mismatch, got input \(2\), mat \(2x8\), vec \(0\)") as failure:
            ranks.run(world_size, train_and_roundtrip, **run)
        assert len(failure.value.errors) == world_size
    elif KEYERROR:
        with pytest.raises(RankFailure, match=r"KeyError: \d+") as failure:
            ranks.run(world_size, train_and_roundtrip, **run)
        assert len(failure.value.errors) == world_size
        assert "in average_tensor" in failure.value.errors[0].traceback
    else:
        check_trained_and_restored(ranks.run(world_size, train_and_roundtrip, **run))


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_safe_zero12_trains_and_restores_a_zero_sized_parameter(ranks, tmp_path, stage, world_size):
    results = ranks.run(world_size, train_and_roundtrip, model="ZeroSized", stage=stage, safe=True,
                        world_size=world_size, ckpt_dir=str(tmp_path))
    check_trained_and_restored(results)
    for r in results:
        assert r["wrapper"] == "SafeDeepSpeedZeroOptimizer"
        assert r["shapes_after"] == {"empty.weight": (0, 8)}
        assert r["flat_buffer_history"] == [False]
        if NEEDED:
            assert r["report"]["zero_element_groups"] == [
                "1 zero-element parameter(s) kept out of SafeDeepSpeedZeroOptimizer"]
        else:
            assert "zero_element_groups" not in r["report"]
        if not NEEDED and not flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
            assert r["report"] == {}, "no fix may act where DeepSpeed has no defect"


# --- FP-Quant-like layout, a zero-element placeholder inside a partition -------------------------------


@pytest.mark.parametrize("stage", [1, 2])
def test_stock_zero12_asserts_on_a_placeholder_inside_a_partition(ranks, tmp_path, stage):
    if FRAGMENT_ASSERT:
        # The placeholder at offset 8 (after q1.bias) is inside the single partition.
        with pytest.raises(RankFailure, match="fragment start 8 should be < fragment_end 8"):
            ranks.run(1, train_and_roundtrip, model="FPQuantLike", stage=stage, safe=False, world_size=1,
                      ckpt_dir=str(tmp_path))
    else:
        check_trained_and_restored(ranks.run(1, train_and_roundtrip, model="FPQuantLike", stage=stage, safe=False,
                                             world_size=1, ckpt_dir=str(tmp_path)))


# --- the shape of a zero-element parameter under the older torch's unflatten ------------------------------------


@contextlib.contextmanager
def legacy_unflatten() -> Iterator[None]:
    """Emulate torch <= 2.9's ``unflatten_dense_tensors``: a zero-element tensor comes back as ``zeros({0})``.

    ``torch._utils._unflatten_dense_tensors`` (the name every DeepSpeed wrapper imported, some
    also caching it as ``self.unflatten``) looks ``torch._C._nn.unflatten_dense_tensors`` up on
    each call, so patching that one attribute reaches all of them.
    """
    original = torch._C._nn.unflatten_dense_tensors

    def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        views = original(flat, tensors)
        return [flat.new_zeros(0) if t.numel() == 0 else v for t, v in zip(tensors, views)]

    torch._C._nn.unflatten_dense_tensors = unflatten
    try:
        yield
    finally:
        torch._C._nn.unflatten_dense_tensors = original


def test_legacy_unflatten_emulation_takes_effect():
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    tensors = [torch.randn(8, 8), torch.randn(0, 8), torch.randn(4)]
    flat = _flatten_dense_tensors(tensors)
    # This torch's own shape for the zero-element tensor, before and after the emulation.
    native = [(8, 8), (0,) if UNFLATTEN_LOSES_EMPTY_SHAPE else (0, 8), (4,)]
    assert [tuple(t.shape) for t in _unflatten_dense_tensors(flat, tensors)] == native
    with legacy_unflatten():
        legacy = _unflatten_dense_tensors(flat, tensors)
    assert [tuple(t.shape) for t in legacy] == [(8, 8), (0,), (4,)]
    assert torch.equal(legacy[2], tensors[2])
    assert [tuple(t.shape) for t in _unflatten_dense_tensors(flat, tensors)] == native


ROUTES = {  # route -> (stock wrapper DeepSpeed builds, how to configure it)
    "bf16_stage0_fused": "FP16_Optimizer",
    "bf16_optimizer": "BF16_Optimizer",
    "zero1": "DeepSpeedZeroOptimizer",
    "zero2": "DeepSpeedZeroOptimizer",
}


def _init_route(route: str, safe: bool, world_size: int) -> Any:
    import deepspeed

    import safe_zero

    model = build(ZeroSized)
    kwargs: dict[str, Any] = {"model": model}
    if route == "bf16_stage0_fused":
        config = ds_config(0, world_size=world_size)
        del config["optimizer"]
        kwargs["optimizer"] = cpu_fused_adam()(model.parameters())
    else:
        config = ds_config(2 if route == "zero2" else 1, world_size=world_size)
        kwargs["model_parameters"] = model.parameters()
        if route == "bf16_optimizer":
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = (safe_zero.initialize if safe else deepspeed.initialize)(config=config, **kwargs)
    return engine


def legacy_route(route: str, world_size: int) -> dict:
    """Under the emulation: stock's shape after initialize, then safe_zero's after init and two steps."""
    with legacy_unflatten():
        stock = _init_route(route, safe=False, world_size=world_size)
        out: dict[str, Any] = {"stock_wrapper": type(stock.optimizer).__name__,
                               "stock_shape": tuple(stock.module.empty.weight.shape)}
        del stock
        safe = _init_route(route, safe=True, world_size=world_size)
        out["wrapper"] = type(safe.optimizer).__name__
        out["report"] = dict(safe.safe_zero_session.report)
        out["shape_init"] = tuple(safe.module.empty.weight.shape)
        out["losses"] = train(safe, 2)
        out["shape_after"] = tuple(safe.module.empty.weight.shape)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("route", list(ROUTES))
def test_zero_element_parameter_keeps_its_shape_under_legacy_unflatten(ranks, request, route, world_size):
    if ENGINE_REDUCES_ZERO_ELEMENT_GRADS and route in ("bf16_stage0_fused", "bf16_optimizer"):
        request.applymarker(pytest.mark.xfail(
            strict=True, raises=RankFailure,
            reason="DeepSpeed < 0.18.5 all-reduces the zero-element gradient in DeepSpeedEngine.allreduce_and_copy"))
    results = ranks.run(world_size, legacy_route, route=route, world_size=world_size)
    for r in results:
        assert r["stock_wrapper"] == ROUTES[route], "the test must reach the wrapper it is about"
        # Stock on a release with the defect rebinds the parameter to torch's zeros({0}).
        assert r["stock_shape"] == ((0,) if SHAPE_LOST[ROUTES[route]] else (0, 8))
        assert r["wrapper"] == "Safe" + ROUTES[route]
        assert r["shape_init"] == r["shape_after"] == (0, 8)
        assert len(r["losses"]) == 2 and all(torch.isfinite(torch.tensor(r["losses"])))
        assert ("zero_element_groups" in r["report"]) == NEEDED
        if not flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
            assert "flat_buffer_autograd" not in r["report"]
        if not NEEDED:
            assert r["report"] == {}, "no fix may act where DeepSpeed has no defect"
    assert results[0]["losses"] == results[-1]["losses"]


def _fp32_state_dict_body(stage: int, ckpt_dir: str) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import safe_zero

    model = build(ZeroSized)
    engine, *_ = safe_zero.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage))
    train(engine, 1)
    engine.save_checkpoint(ckpt_dir, tag="t")
    shapes = lambda state: {name: tuple(t.shape) for name, t in state.items()}  # noqa: E731
    return {"deepspeed": shapes(get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="t")),
            "safe_zero": shapes(safe_zero.get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="t")),
            "module": {name: tuple(p.shape) for name, p in engine.module.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_to_fp32_has_every_parameter_with_its_shape(ranks, tmp_path, stage):
    r, = ranks.run(1, _fp32_state_dict_body, stage=stage, ckpt_dir=str(tmp_path / "ckpt"))
    # Red on stock, asserted: the zero-element parameter is in no optimizer group and, at ZeRO-1, not saved with the
    # frozen ones either, so DeepSpeed's zero_to_fp32 leaves it out.
    if stage == 1:
        assert "empty.weight" not in r["deepspeed"]
    assert r["safe_zero"] == r["module"] and r["safe_zero"]["empty.weight"] == (0, 8)


def test_gradless_zero_fill_keeps_a_zero_element_shape_under_the_older_unflatten():
    """The gradless fix's zero gradients are views of one buffer: a zero-element parameter's keeps its shape on torch
    <= 2.9 too (else autograd refuses it: "attempting to assign a gradient of size '[0]' to a tensor of size
    '[0, 8]'", seen on torch 2.5.1, 2.6.0 and 2.8.0)."""
    from safe_zero.fixes.gradless.gradients import zero_grads_for
    from safe_zero.session import Session

    params = [torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(0, 8))]
    with legacy_unflatten():
        zero_grads_for([(p, p.shape, "cpu", "had no gradient") for p in params], set(), Session())
    assert [tuple(p.grad.shape) for p in params] == [(4, 8), (0, 8)]
    assert not params[0].grad.any()
