"""Rank bodies shared by more than one test module (run on the rig's ranks, so module-level functions)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from torch import nn
from torch._utils import _unflatten_dense_tensors

from safe_zero._compat import DEEPSPEED_VERSION
from tests.support.models import Control, FPQuantLike, Gradless, ZeroSized, build, ds_config, train

#: 0.18.x before 0.19.6 asserts ``fragment start N should be < fragment_end N`` on FPQuantLike at ZeRO-1/2 (#8298).
FRAGMENT_ASSERT = DEEPSPEED_VERSION in SpecifierSet("<0.19.6")
#: torch up to 2.9 (at least) unflattens a zero-element tensor as shape ``(0,)``: DeepSpeed < 0.19.7's ZeRO-1/2 rebinds
#: a zero-element parameter to that view, and stock's forward stops on its shape (``size mismatch ... vec (0)``).
UNFLATTEN_LOSES_EMPTY_SHAPE = _unflatten_dense_tensors(torch.zeros(0), [torch.zeros(0, 8)])[0].shape != (0, 8)


def _hook_runs_without_a_gradient() -> bool:
    """Whether torch runs a parameter's post-accumulate-grad hook when its gradient stays None (2.13 does, 2.4 and 2.5
    do not): stock DeepSpeed's ZeRO-1/2/3 gradient hook then stops on the grad-less parameter (``None.view``)."""
    model = Gradless()
    ran: list[nn.Parameter] = []
    model.dqweight.register_post_accumulate_grad_hook(ran.append)
    model(torch.ones(1, 8)).backward()
    return bool(ran)


#: False: stock DeepSpeed does not stop on a grad-less parameter (the gradless_params probe finds no defect).
HOOK_RUNS_WITHOUT_A_GRADIENT = _hook_runs_without_a_gradient()

MODELS: dict[str, type] = {"Control": Control, "ZeroSized": ZeroSized, "FPQuantLike": FPQuantLike}


def _zero_element_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in module.named_parameters() if p.numel() == 0}


def train_and_roundtrip(model: str, stage: int, safe: bool, world_size: int, ckpt_dir: str, steps: int = 3) -> dict:
    """Train ``steps``, checkpoint, load into a fresh differently-seeded engine, train both on."""
    import deepspeed

    import safe_zero
    init = safe_zero.initialize if safe else deepspeed.initialize
    config = ds_config(stage, world_size=world_size)

    first = build(MODELS[model], seed=0)
    expected_shapes = _zero_element_shapes(first)
    # DeepSpeed pops keys (torch_adam) out of the config it is given: each engine gets its own copy.
    engine, *_ = init(model=first, model_parameters=first.parameters(), config=copy.deepcopy(config))
    result: dict[str, Any] = {
        "wrapper": type(engine.optimizer).__name__,
        "report": dict(getattr(engine, "safe_zero_session", None).report) if safe else None,
        "expected_shapes": expected_shapes,
        "shapes_init": _zero_element_shapes(engine.module),
    }
    result["flat_buffer_history"] = [t.requires_grad or t.grad_fn is not None
                                     for t in engine.optimizer.bit16_groups_flat]
    result["losses"] = train(engine, steps)
    result["shapes_after"] = _zero_element_shapes(engine.module)

    engine.save_checkpoint(ckpt_dir, tag="roundtrip")
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    saved_master = [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]

    second = build(MODELS[model], seed=1)
    fresh, *_ = init(model=second, model_parameters=second.parameters(), config=copy.deepcopy(config))
    result["differed_before_load"] = [n for n, p in fresh.module.named_parameters()
                                      if p.numel() and not torch.equal(p, saved[n])]
    fresh.load_checkpoint(ckpt_dir, tag="roundtrip")
    loaded = dict(fresh.module.named_parameters())
    result["not_restored"] = [n for n, p in saved.items()
                              if loaded[n].shape != p.shape or loaded[n].dtype != p.dtype
                              or not torch.equal(loaded[n], p)]
    result["master_restored"] = len(saved_master) == len(fresh.optimizer.single_partition_of_fp32_groups) and all(
        torch.equal(a, b) for a, b in zip(saved_master, fresh.optimizer.single_partition_of_fp32_groups))
    result["shapes_loaded"] = _zero_element_shapes(fresh.module)
    # Both engines now hold the same state: the same further batches must give the same losses.
    result["continued"] = train(engine, 2, seed=1)
    result["continued_fresh"] = train(fresh, 2, seed=1)
    return result


def check_trained_and_restored(results: list[dict], steps: int = 3) -> None:
    """Assertions shared with ``test_flat_buffer_autograd``: training, shapes, bit-identical round trip."""
    for r in results:
        assert len(r["losses"]) == steps
        assert all(torch.isfinite(torch.tensor(r["losses"] + r["continued"])))
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["shapes_init"] == r["expected_shapes"] == r["shapes_after"] == r["shapes_loaded"]
        assert r["differed_before_load"], \
            "the fresh engine must start from other values, or the round trip proves nothing"
        assert r["not_restored"] == [], f"parameters not restored bit-identically: {r['not_restored']}"
        assert r["master_restored"], "the fp32 master partition must be restored bit-identically"
        assert r["continued"] == r["continued_fresh"]
    assert results[0]["losses"] == results[-1]["losses"], "ranks must agree"
