"""Rank bodies for ``benchmarks/run.py``: each runs on every rank of a CPU/gloo pool (safe_zero/ranks.py)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


class Wide(nn.Module):
    """A model stock DeepSpeed trains (no zero-sized parameters): the step-time control."""

    def __init__(self, hidden: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()


class WithEmpty(nn.Module):
    """``Wide`` plus K submodules whose only parameters are zero-sized, in the forward path."""

    def __init__(self, k: int, hidden: int = 256) -> None:
        super().__init__()
        self.body = Wide(hidden)
        self.empties = nn.ModuleList(nn.Linear(hidden, 0, bias=False) for _ in range(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + sum(e(x).sum() for e in self.empties)


def _config(stage: int, options: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            **({"safe_zero": options} if options else {})}


def _engine(model: nn.Module, stage: int, safe: bool | dict[str, Any]) -> Any:
    """A stock (``False``) or safe_zero engine (``True``, or a dict: its ``"safe_zero"`` block)."""
    import deepspeed

    import safe_zero

    init = safe_zero.initialize if safe is not False else deepspeed.initialize
    options = safe if isinstance(safe, dict) else None
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=_config(stage, options))
    return engine


def paired_step_seconds(stage: int, pairs: int = 60, warmup: int = 3, safe: tuple[Any, Any] = (False, True),
                        b_built_first: bool = False) -> list[tuple[float, float]]:
    """``(a, b)`` seconds of ``pairs`` training steps of ``Wide``, taken alternately on two engines.

    ``safe`` says which of engines a and b run safe_zero: ``(False, True)`` compares stock with
    safe_zero, ``(False, False)`` is the A/A control that shows the harness's noise. Both engines
    live in this process from the same seed, so a pair shares the machine's state at that moment;
    which engine steps first alternates so neither gets the warmer caches. Which one is built
    first (and so where its buffers land) is the caller's choice: run both.
    """
    import torch.distributed as dist

    engines = {}
    for which in ("b", "a") if b_built_first else ("a", "b"):
        torch.manual_seed(0)
        engines[which] = _engine(Wide(), stage, safe["ab".index(which)])
    x = torch.randn(8, 256).to(torch.bfloat16)

    def timed_step(which: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        loss = engines[which](x)
        engines[which].backward(loss)
        engines[which].step()
        return time.perf_counter() - start

    for _ in range(warmup):
        for which in "ab":
            timed_step(which)
    times = []
    for i in range(pairs):
        got = {which: timed_step(which) for which in ("ab" if i % 2 == 0 else "ba")}
        times.append((got["a"], got["b"]))
    return times


def safe_zero_share(stage: int, steps: int = 30, warmup: int = 3) -> dict[str, float]:
    """Under cProfile, the share of a safe_zero step spent in safe_zero's own functions, and their calls per step.

    An upper bound on what safe_zero's Python adds (the profiler inflates Python calls, not kernels),
    and a count that does not depend on the machine's load.
    """
    import cProfile
    import pstats

    torch.manual_seed(0)
    engine = _engine(Wide(), stage, True)
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
    ours = [v for k, v in stats.items() if "/safe_zero/" in k[0]]
    return {"share": sum(v[2] for v in ours) / sum(v[2] for v in stats.values()),
            "calls_per_step": sum(v[1] for v in ours) / steps}


def all_gathers_per_step(k: int, steps: int = 3) -> list[int]:
    """All-gathers DeepSpeed's comm backend issues per ZeRO-3 step with safe_zero, K all-zero-sized submodules."""
    from deepspeed.comm import comm

    torch.manual_seed(0)
    engine = _engine(WithEmpty(k), 3, safe=True)
    names = ("all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced")
    count = [0]

    def counting(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in names:
        setattr(comm.cdb, name, counting(getattr(comm.cdb, name)))
    try:
        x = torch.randn(8, 256).to(torch.bfloat16)
        per_step = []
        for _ in range(steps):
            count[0] = 0
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            per_step.append(count[0])
    finally:
        for name in names:
            delattr(comm.cdb, name)
    return per_step


COLLECTIVES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_gather_base",
               "all_gather_coalesced", "broadcast", "all_to_all_single")


def collectives_per_step(stage: int, safe: bool, steps: int = 3) -> list[dict[str, int]]:
    """Per step: calls of each collective DeepSpeed's comm backend issues on ``Wide`` (every rank uses every parameter).

    ``all_reduce_bytes`` adds up the bytes those all-reduces carry, to size any collective safe_zero adds.
    """
    from deepspeed.comm import comm

    torch.manual_seed(0)
    engine = _engine(Wide(), stage, safe=safe)
    step: dict[str, int] = {}

    def counting(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            step[name] = step.get(name, 0) + 1
            if name == "all_reduce":
                tensor = kwargs.get("tensor", args[0] if args else None)
                step["all_reduce_bytes"] = step.get("all_reduce_bytes", 0) + tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return wrapper

    names = [name for name in COLLECTIVES if hasattr(comm.cdb, name)]
    for name in names:
        setattr(comm.cdb, name, counting(name, getattr(comm.cdb, name)))
    try:
        x = torch.randn(8, 256).to(torch.bfloat16)
        per_step = []
        for _ in range(steps):
            step.clear()
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            per_step.append(dict(step))
    finally:
        for name in names:
            delattr(comm.cdb, name)
    return per_step
