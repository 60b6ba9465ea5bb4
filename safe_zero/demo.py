"""``python -m safe_zero demo``: stock DeepSpeed and safe_zero side by side on CPU.

One tiny model holds what real fine-tuning jobs bring: a zero-sized parameter (an FP-Quant
placeholder / rank-0 adapter), a trainable parameter that gets no gradient (FP-Quant's
``dqweight``) and a grouped_mm MoE expert weight. Each configuration is trained with stock
``deepspeed.initialize`` and with ``safe_zero.initialize`` in the same process.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import torch
from torch import nn

from safe_zero.alignment import mark_grouped_mm
from safe_zero.probes import DropGrad, init_single_process

STEPS = 4


class DemoModel(nn.Module):
    """dense -> 4 experts (grouped matmul) -> head, plus a zero-sized and a grad-less parameter."""

    def __init__(self, hidden: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.odd = nn.Parameter(torch.randn(3) * 0.1)  # an odd-numel parameter ahead of the experts
        self.dense = nn.Linear(hidden, hidden)
        # Stands in for grouped_mm experts: marked, so safe_zero keeps it 16-byte aligned.
        self.experts = mark_grouped_mm(nn.Parameter(torch.randn(experts, hidden, hidden) * 0.1))
        self.placeholder = nn.Linear(hidden, 0, bias=False)  # zero-sized, trainable
        self.dqweight = nn.Parameter(torch.full((hidden, ), 1.0 / hidden))  # trainable, never gets a gradient
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dense(x)) + self.odd.sum()
        # Every expert sees every token: a batched matmul stands in for grouped_mm on CPU.
        h = torch.einsum("bh,ehk->bk", h, self.experts) / self.experts.shape[0]
        h = DropGrad.apply(h, self.dqweight)
        return (self.head(h) - 1).pow(2).mean() + self.placeholder(x).sum()


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-2, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def _run(init: Callable[..., Any], stage: int) -> tuple[str, str, str]:
    """(result, losses, expert-weight alignment) for one configuration."""
    import deepspeed

    torch.manual_seed(0)
    model = DemoModel()
    try:
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=_config(stage))
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        losses = []
        for _ in range(STEPS):  # one fixed batch, so the falling loss is easy to read
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        experts = engine.module.experts
        if stage == 3:
            with deepspeed.zero.GatheredParameters([experts]):
                offset = experts.data_ptr() % 16
        else:
            offset = experts.data_ptr() % 16
        return "trains", " -> ".join(f"{v:.4f}" for v in losses), f"data_ptr % 16 = {offset}"
    except Exception as e:  # the point of the demo: show what stock raises
        message = str(e).splitlines()[0] if str(e) else ""
        return f"FAILS: {type(e).__name__}: {message[:60]}", "-", "-"


def main() -> int:
    init_single_process()
    import logging
    import warnings

    import deepspeed

    import safe_zero

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")  # torch's deprecation notes from DeepSpeed's collectives drown the table
    print(f"safe_zero demo: DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, CPU, 1 rank, bf16, "
          f"{STEPS} steps", flush=True)
    rows = []
    for stage in (2, 3):
        for name, init in (("stock", deepspeed.initialize), ("safe_zero", safe_zero.initialize)):
            start = time.monotonic()
            print(f"  running ZeRO-{stage} with {name} ...", end="", flush=True)
            rows.append((f"ZeRO-{stage}", name, *_run(init, stage)))
            print(f" {time.monotonic() - start:.1f}s", flush=True)
    widths = [max(len(str(r[i])) for r in rows + [_HEADER]) for i in range(len(_HEADER))]
    for row in [_HEADER, tuple("-" * w for w in widths)] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    safe_ok = all(r[2] == "trains" for r in rows if r[1] == "safe_zero")
    print("safe_zero trained every configuration." if safe_ok else "safe_zero FAILED a configuration.")
    return 0 if safe_ok else 1


_HEADER = ("config", "initialize", "result", "loss", "expert weight alignment")

if __name__ == "__main__":
    sys.exit(main())
