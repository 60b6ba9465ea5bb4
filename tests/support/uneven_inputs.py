"""What the uneven-input tests (``tests/test_uneven_inputs.py``, and under Accelerate) share: the model, its
DeepSpeed config, and how close a run must come to the single-process reference."""

from __future__ import annotations

import torch
from torch import nn

LR = 1e-2
TOLERANCE = 1e-5


class Regression(nn.Module):
    """Two linear layers and the loss: the forward returns it, as a model with labels does."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.relu(self.a(x))) - y).pow(2).mean()


def config(stage: int, world_size: int, accumulation: int, dtype: str) -> dict:
    return {"train_batch_size": 2 * accumulation * world_size, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
            **({"bf16": {"enabled": True}} if dtype == "bf16" else {})}


def max_error(params: dict, expected: dict) -> float:
    assert params.keys() == expected.keys()
    return max((params[n] - expected[n]).abs().max().item() for n in expected)
