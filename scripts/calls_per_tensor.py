"""safe_zero's own Python calls per trainable tensor in one training step, under cProfile (issue 26).

``python scripts/calls_per_tensor.py [--blocks 170] [--stages 2 3]`` runs 2 CPU/gloo ranks on a model of
``blocks`` blocks of ``Linear(256, 16) + Linear(16, 256) + LayerNorm(256)`` (6 tensors each), bf16, takes
three warm-up steps and profiles the next ``--steps`` on each rank. It prints, per stage, rank 0's safe_zero
calls per tensor per step (functions whose file lies under ``safe_zero/``), their share of the profiled steps'
own time (noisy on a loaded machine: profile several steps), and the functions that make the calls.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Blocks(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 16), nn.Linear(16, 256), nn.LayerNorm(256))
                                    for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.float().pow(2).mean()


def profiled_steps(stage: int, blocks: int, steps: int, warmup: int = 3) -> dict:
    """On every rank: warm up, then one profiled step; per safe_zero function its calls and own time, safe_zero's
    share of the step's own time, the tensor count."""
    import cProfile
    import pstats

    import safe_zero

    torch.manual_seed(0)
    model = Blocks(blocks)
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = safe_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(8, 256).to(torch.bfloat16)
    for i in range(warmup + steps):
        if i == warmup:
            profile = cProfile.Profile()
            profile.enable()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
    profile.disable()
    stats = pstats.Stats(profile).stats
    ours = {f"{os.path.relpath(k[0], os.path.dirname(safe_zero.__file__))}:{k[1]}:{k[2]}": (v[1] / steps, v[2])
            for k, v in stats.items() if "/safe_zero/" in k[0]}
    share = sum(v[2] for k, v in stats.items() if "/safe_zero/" in k[0]) / sum(v[2] for v in stats.values())
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    return {"calls": ours, "share": share, "tensors": tensors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=170)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    from tests.rig import DistPool

    pool = DistPool(2)
    try:
        for stage in args.stages:
            result = pool.run(profiled_steps, stage=stage, blocks=args.blocks, steps=args.steps, timeout=1800)[0]
            total = sum(calls for calls, _ in result["calls"].values())
            own = sum(seconds for _, seconds in result["calls"].values())
            print(f"ZeRO-{stage}, {result['tensors']} tensors, rank 0: {total:.0f} safe_zero calls per step = "
                  f"{total / result['tensors']:.2f} per tensor, {100 * result['share']:.2f}% of the profiled time")
            for name, (calls, seconds) in sorted(result["calls"].items(), key=lambda kv: -kv[1][0])[:args.top]:
                per_tensor = calls / result["tensors"]
                print(f"  {calls:9.1f}  {per_tensor:.2f}/tensor  {100 * seconds / own:5.1f}% of safe_zero's "
                      f"time  {name}")
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
