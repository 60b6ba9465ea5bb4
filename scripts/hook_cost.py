"""What safe_zero's gradient-hook override adds per hook, without a profiler (issue 26).

``python scripts/hook_cost.py [--tensors 20000]`` calls the ZeRO-1/2 and ZeRO-3 overrides' in-order fast path
(``ReduceInOneOrderStage12.process_gradients``, ``ReduceInOneOrderStage3.reduce_ready_partitions_and_remove_grads``)
once per parameter of an agreed order, with DeepSpeed's hook body replaced by a function that does nothing, and
the same loop calling that function directly. The difference is safe_zero's own cost per hook, the number cProfile
inflates: under a profiler every call pays the profiler's bookkeeping, so a function that makes one call per hook,
among DeepSpeed's dozen, shows several times its cost. It also times the first read of ``param.grad`` after a
backward (which creates the gradient's Python object) against a later one: the override's read moves that creation
from DeepSpeed's hook body into safe_zero's.

``--zero-fill`` instead times the zero gradients of a run of unused experts on DeepSpeed's accelerator (a GPU where
there is one): ``collectives.zero_grads_for`` (views of one zeroed buffer per run) against one ``torch.zeros`` per
parameter, the device synchronized after each run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _nothing(param: Any, *args: Any) -> None:
    pass


def _per_call_ns(loop: Callable[[], None], n: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        loop()
        samples.append((time.perf_counter_ns() - start) / n)
    return statistics.median(samples)


def fast_path_ns(stage: int, params: list[torch.nn.Parameter], repeats: int) -> tuple[float, float]:
    """(ns per hook through the override's fast path, ns per direct call of the stock body)."""
    from safe_zero.fixes.gradless_params import ReduceInOneOrderStage3, ReduceInOneOrderStage12

    n = len(params)
    end = (object(), () if stage == 2 else 0, n)
    steps = [(p, () if stage == 2 else 0, k + 1) for k, p in enumerate(params)] + [end]
    # wake_task -1: the walk's autograd task, as outside a backward, where this loop runs
    planner = SimpleNamespace(step=steps[0], steps=steps, wake_at=0, wake_task=-1)
    optimizer = SimpleNamespace(_safe_zero_planner=planner, _safe_zero_stock_hook=_nothing,
                                _safe_zero_clock=SimpleNamespace(position=0))
    if stage == 2:
        override: Callable[..., None] = ReduceInOneOrderStage12.process_gradients
    else:
        override = ReduceInOneOrderStage3.reduce_ready_partitions_and_remove_grads
    indexed = list(enumerate(params))

    def through_override() -> None:
        planner.step = steps[0]
        for i, p in indexed:
            override(optimizer, p, i)

    def direct() -> None:
        stock = optimizer._safe_zero_stock_hook
        for i, p in indexed:
            stock(p, i)

    return _per_call_ns(through_override, n, repeats), _per_call_ns(direct, n, repeats)


def grad_read_ns(params: list[torch.nn.Parameter], repeats: int) -> tuple[float, float]:
    """(ns for the first ``param.grad`` read after a backward, ns for a later one)."""
    first, later = [], []
    for _ in range(repeats):
        for p in params:
            p.grad = None
        torch.stack([p.sum() for p in params]).sum().backward()

        def read() -> None:
            for p in params:
                p.grad is None  # noqa: B015  the read is what is timed

        first.append(_per_call_ns(read, len(params), 1))
        later.append(_per_call_ns(read, len(params), 1))
    return statistics.median(first), statistics.median(later)


#: An expert's three weights (gate, up, down) at the bench models' hidden size 16, bf16.
EXPERT_SHAPES = ((64, 16), (64, 16), (16, 64))


def zero_fill_us(experts: int, repeats: int) -> tuple[float, float]:
    """(us per run of ``experts`` experts' zero gradients from one buffer, us with one allocation per parameter)."""
    from deepspeed.accelerator import get_accelerator

    from safe_zero.fixes.gradless.collectives import zero_grads_for

    accelerator = get_accelerator()
    device = torch.device(accelerator.current_device_name())
    params = [torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device=device))
              for _ in range(experts) for shape in EXPERT_SHAPES]
    for p in params:
        p._safe_zero_gradless_reported = True  # the report's first-time wording is not what is timed
    wanted = [(p, p.shape, device, "") for p in params]

    def buffers() -> None:
        zero_grads_for(None, wanted)
        accelerator.synchronize()

    def one_each() -> None:
        for p in params:
            p.grad = torch.zeros(p.shape, dtype=p.dtype, device=device)
        accelerator.synchronize()

    for loop in (buffers, one_each):  # warm the allocator
        loop()
    return _per_call_ns(buffers, 1, repeats) / 1e3, _per_call_ns(one_each, 1, repeats) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--zero-fill", action="store_true", help="time zero gradients of unused experts instead")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the bench's ranks run
    if args.zero_fill:
        for experts in (1, 8, 32, 128):
            ours, each = zero_fill_us(experts, args.repeats)
            print(f"zero gradients of {experts} unused experts ({3 * experts} tensors): one buffer {ours:.1f} us, "
                  f"one allocation each {each:.1f} us ({each / ours:.2f}x)")
        return
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(args.tensors)]
    torch.stack([p.sum() for p in params]).sum().backward()  # every gradient exists, its Python object too
    for p in params:
        p.grad is None  # noqa: B015
    for stage in (2, 3):
        ours, bare = fast_path_ns(stage, params, args.repeats)
        print(f"ZeRO-{stage if stage == 3 else '1/2'} hook override, in-order fast path: {ours:.0f} ns per hook, "
              f"a direct call of the stock body {bare:.0f} ns: safe_zero adds {ours - bare:.0f} ns per hook")
    first, later = grad_read_ns(params, 5)
    print(f"param.grad after a backward: first read {first:.0f} ns (creates the Python object), later reads "
          f"{later:.0f} ns: the override's read adds about {later:.0f} ns and saves DeepSpeed's hook body "
          f"{first - later:.0f} ns")


if __name__ == "__main__":
    main()
