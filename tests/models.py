"""Tiny models and configs shared by the tests: each reproduces one defect in a few parameters."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class ZeroSized(nn.Module):
    """REFERENCE §1's minimal failing model: a dense layer beside a layer with zero output features."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.empty = nn.Linear(8, 0, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x).pow(2).mean() + self.empty(x).sum()


class _DropGrad(torch.autograd.Function):
    """Uses ``w`` in the forward but returns no gradient for it, as FP-Quant's pseudo-quant kernel does."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        return x * w.sum()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class Gradless(nn.Module):
    """A trainable parameter whose gradient stays ``None`` after backward (FP-Quant's ``dqweight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.dqweight = nn.Parameter(torch.full((4, 8), 0.125))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DropGrad.apply(self.dense(x), self.dqweight).pow(2).mean()


class Control(nn.Module):
    """No zero-sized and no grad-less parameters: stock DeepSpeed trains it."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.dense(x))).pow(2).mean()


def ds_config(stage: int, *, dtype: str = "bf16", batch: int = 2, world_size: int = 1, **zero: Any) -> dict:
    """A DeepSpeed config for ``stage`` with torch Adam (no compiled ops needed on CPU)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch * world_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **zero},
        "steps_per_print": 10**9,
    }
    if dtype in ("bf16", "fp16"):
        config[dtype] = {"enabled": True}
    return copy.deepcopy(config)


def batches(steps: int, *, batch: int = 2, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    """The same inputs on every rank and every run, so losses compare bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 8, generator=g).to(dtype) for _ in range(steps)]


def train(engine: Any, steps: int, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[float]:
    losses = []
    for x in batches(steps, dtype=dtype, seed=seed):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def build(model_cls: type, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return model_cls()
