"""Where a safe_zero step's time goes against stock's, function by function (issue 26).

``python scripts/diff_profile.py --stage 3 --model moe --tensors 20000 --steps 4 [--safe-first]`` builds a stock and
a safe_zero engine of a bench model (``benchmarks/bodies.py``) in each of 2 gloo ranks, steps them alternately
(garbage collection off, a barrier before each step) under one cProfile each, and prints, for rank 0, each engine's
wall time per step, the own time per step by where the code lives (safe_zero, DeepSpeed, torch, C builtins, the
rest) and the functions whose own time differs most, with their calls per step. Equal calls with unequal time is
the machine, not work; ``--safe-first`` builds the safe_zero engine first, since where an engine's buffers land
moves its step by several percent.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from benchmarks import bodies  # noqa: E402
from tests.rig import DistPool  # noqa: E402

GROUPS = ("safe_zero", "deepspeed", "torch", "builtins", "other")


def profiled_steps(stage: int, model: str, tensors: int, steps: int, safe_first: bool) -> dict[str, Any]:
    """Per engine (``"stock"``, ``"safe"``): wall seconds per step and ``{function: [calls, own s/step]}``."""
    import cProfile
    import gc
    import pstats

    import torch.distributed as dist

    with bodies._threads_for(model):
        engines = {}
        for safe in ((True, False) if safe_first else (False, True)):
            module = bodies.build(model, tensors)
            engines[safe] = bodies._engine(module, stage, safe)
        x = bodies.example_input(module)
        for engine in engines.values():
            bodies._step(engine, x)
        profiles = {safe: cProfile.Profile() for safe in engines}
        wall = dict.fromkeys(engines, 0.0)
        gc.disable()
        try:
            for i in range(steps):
                for safe in ((False, True) if i % 2 == 0 else (True, False)):
                    gc.collect()
                    dist.barrier()
                    started = time.perf_counter()
                    profiles[safe].enable()
                    bodies._step(engines[safe], x)
                    profiles[safe].disable()
                    wall[safe] += time.perf_counter() - started
        finally:
            gc.enable()
        return {("safe" if safe else "stock"): {
            "wall": wall[safe] / steps,
            "functions": {f"{k[0]}:{k[1]}:{k[2]}": [v[1] / steps, v[2] / steps]
                          for k, v in pstats.Stats(profile).stats.items()}}  # type: ignore[attr-defined]
            for safe, profile in profiles.items()}


def _group(function: str) -> str:
    if bodies._ours(function) is not None:  # the bench's own test of what is safe_zero's
        return "safe_zero"
    for marker, group in (("/deepspeed/", "deepspeed"), ("/torch/", "torch")):
        if marker in function:
            return group
    return "builtins" if function.startswith("~") else "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--model", default="moe")
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--safe-first", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    pool = DistPool(2)
    try:
        ranks = pool.run(profiled_steps, stage=args.stage, model=args.model, tensors=args.tensors, steps=args.steps,
                         safe_first=args.safe_first, timeout=3600)
    finally:
        pool.close()
    for rank, got in enumerate(ranks):
        print(f"rank {rank}: wall per step, stock {1e3 * got['stock']['wall']:.0f} ms, "
              f"safe_zero {1e3 * got['safe']['wall']:.0f} ms")
    stock, safe = ranks[0]["stock"]["functions"], ranks[0]["safe"]["functions"]
    for group in GROUPS:
        before = sum(v[1] for k, v in stock.items() if _group(k) == group)
        after = sum(v[1] for k, v in safe.items() if _group(k) == group)
        print(f"{group:10} own time per step: stock {1e3 * before:8.1f} ms, safe_zero {1e3 * after:8.1f} ms "
              f"({1e3 * (after - before):+.1f})")
    none = [0.0, 0.0]
    apart = sorted(stock.keys() | safe.keys(), key=lambda k: -abs(safe.get(k, none)[1] - stock.get(k, none)[1]))
    for k in apart[:args.top]:
        a, b = stock.get(k, none), safe.get(k, none)
        print(f"{1e3 * (b[1] - a[1]):+8.2f} ms  calls per step {a[0]:9.1f} -> {b[0]:9.1f}  {k[-100:]}")


if __name__ == "__main__":
    main()
