"""grouped_mm engines on any ZeRO route, stock or safe_zero, that record where each expert weight handed to
grouped_mm lies on the 16-byte grid (CPU grouped_mm does not check alignment, so the tests assert
``data_ptr() % 16 == 0`` themselves): the alignment, world-size and checkpoint tests' shared set-up."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from tests.support.models import (HAS_GROUPED_MM, Gradless, OddExperts, TinyDeepseekV3, TinyGptOss, TinyOlmoe,
                                  TinyQwen3Moe, ZeroSized, batches, build, ds_config)

LAYOUTS = {"deepseek_v3": TinyDeepseekV3, "gpt_oss": TinyGptOss, "qwen3_moe": TinyQwen3Moe, "olmoe": TinyOlmoe,
           "odd": OddExperts, "zero_sized": ZeroSized, "gradless": Gradless}

ROUTES = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3": dict(stage=3, zero={"stage3_param_persistence_threshold": 0}),
    "bf16_optimizer": dict(stage=1, data_types={"grad_accum_dtype": "fp32"}),
}

#: ZeRO-1/2 cases of a checkpoint move: a route of ``ROUTES`` and more ``zero_optimization`` settings.
ZERO12 = {"stage1": ("stage1", {}), "stage2": ("stage2", {}),
          "stage2_round_robin": ("stage2", {"round_robin_gradients": True})}


def _bf16_optimizer_reachable() -> bool:
    # Early 0.18.x releases gave BFLOAT16 and DDP_BFLOAT16 the same value ("bf16"), so ZeRO-1 + bf16 + fp32
    # accumulation lands on FP16_UnfusedOptimizer, which keeps every parameter in its own tensor.
    from deepspeed.runtime import constants

    return constants.BFLOAT16 != constants.DDP_BFLOAT16


BF16_OPTIMIZER_REACHABLE = _bf16_optimizer_reachable()


def route_config(route: str) -> dict:
    spec = dict(ROUTES[route])
    config = ds_config(spec.pop("stage"), **spec.pop("zero", {}))
    config.update(spec)
    return config


def zero12_config(case: str, alignment: bool = True, load_universal: bool = False) -> dict:
    route, zero = ZERO12[case]
    config = route_config(route)
    config["zero_optimization"].update(zero)
    if not alignment:  # safe_zero in stock's flat order
        config["safe_zero"] = {"alignment": False}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return config


@contextlib.contextmanager
def recording(seen: list[int]):
    """Record ``data_ptr() % 16`` of every 3-D weight operand handed to grouped_mm."""
    if not HAS_GROUPED_MM:  # nothing can call it (the layouts that do skip there)
        yield
        return
    stock = torch.nn.functional.grouped_mm

    def grouped_mm(mat_a, mat_b, *args, **kwargs):
        seen.append(mat_b.data_ptr() % 16)
        return stock(mat_a, mat_b, *args, **kwargs)

    torch.nn.functional.grouped_mm = grouped_mm
    try:
        yield
    finally:
        torch.nn.functional.grouped_mm = stock


def build_engine(layout: str | type[nn.Module], config: dict, safe: bool):
    """An engine of ``LAYOUTS[layout]`` (or of the model class ``layout``)."""
    import deepspeed

    import safe_zero

    model = build(LAYOUTS[layout] if isinstance(layout, str) else layout)
    init = safe_zero.initialize if safe else deepspeed.initialize
    # A copy: DeepSpeed < 0.19 pops "torch_adam" from the config it is given, so a second engine built from the
    # same dict would get DeepSpeed's own Adam instead of torch's.
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=copy.deepcopy(config))
    return engine


def train_recording(engine, steps: int, seen: list[int]) -> list[float]:
    """Steps on one fixed batch (so the loss must fall), recording the grouped_mm operands."""
    losses = []
    x = batches(1)[0]
    with recording(seen):
        for _ in range(steps):
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
    return losses


def gathered_values(engine) -> list[torch.Tensor]:
    """Every parameter's full value (gathered under ZeRO-3)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]
