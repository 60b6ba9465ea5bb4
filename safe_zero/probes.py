"""Tiny stock-DeepSpeed runs that show whether this installation has each defect.

A version table says what a release *should* do; a probe shows what this installation (this
DeepSpeed, this torch) *does*. Each probe builds a model of a few parameters, runs stock
``deepspeed.initialize`` at world size 1, and looks at the symptom or at its root cause.
They need an initialized process group: :func:`init_single_process` sets up one CPU rank.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import socket
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.function import FunctionCtx


class ZeroSized(nn.Module):
    """The minimal model stock ZeRO-3 fails on: a dense layer beside a layer with zero output features."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.empty = nn.Linear(8, 0, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x).pow(2).mean() + self.empty(x).sum()


class DropGrad(torch.autograd.Function):
    """``x * w.sum()`` that returns no gradient for ``w``, as FP-Quant's pseudo-quant kernel does for ``dqweight``."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w.sum()

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gradless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.dqweight = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DropGrad.apply(self.dense(x), self.dqweight).sum()


class _ExpertsAfterOddParam(nn.Module):
    """A 6-byte parameter, then an expert weight: flattened back to back, the weight starts 6 bytes off the grid."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.experts = nn.Parameter(torch.ones(2, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.experts[0]).sum() * self.scale.sum()


def deepspeed_shm_segments(port: int | str = "*") -> set[str]:
    """The /dev/shm workspaces of DeepSpeed's CPU comm op for the group on ``port`` ("*": all of this user's).

    The op creates one ~66 MB segment per rank and never unlinks it (its ``shared_close`` has no
    caller): each CPU process group leaves them behind until reboot.
    """
    return set(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def release_shm(paths: set[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def init_single_process() -> None:
    """One CPU rank with gloo, unless a launcher already set up the process group."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        # This process owns the group, so it owns the shm workspace DeepSpeed will leave behind.
        atexit.register(lambda: release_shm(deepspeed_shm_segments(port)))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    import deepspeed

    from safe_zero.op_builds import check_op_build

    check_op_build()  # the process group loads DeepSpeed's CPU comm op: say so if it builds, refuse a stale lock

    deepspeed.init_distributed(dist_backend="gloo")


def _engine(model_cls: type, stage: int) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = model_cls()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _step(engine: Any) -> None:
    loss = engine(torch.ones(2, 8, dtype=torch.bfloat16))
    engine.backward(loss)
    engine.step()


def _raises(fn: Callable[[], Any], *errors: type[BaseException]) -> bool:
    try:
        fn()
    except errors:
        return True
    return False


def probe_zero3_zero_element_params() -> bool:
    return _raises(lambda: _step(_engine(ZeroSized, 3)), AssertionError, ValueError)


def probe_gradless_params() -> bool:
    return _raises(lambda: _step(_engine(_Gradless, 2)), AttributeError)


def probe_zero_element_groups() -> bool:
    """Root cause: a zero-element parameter inside the ZeRO-1/2 flat groups (or a crash on the way there)."""

    def inside() -> bool:
        engine = _engine(ZeroSized, 2)
        return any(p.numel() == 0 for group in engine.optimizer.bit16_groups for p in group)

    try:
        return inside()
    except (KeyError, AssertionError):
        return True


def probe_flat_buffer_autograd() -> bool:
    """Root cause: the ZeRO-1/2 flat buffer carries autograd history (the symptom needs 2 gloo ranks)."""
    engine = _engine(ZeroSized, 1)
    return any(flat.requires_grad for flat in engine.optimizer.bit16_groups_flat)


def probe_grouped_mm_alignment() -> bool:
    """Root cause: stock ZeRO-2 (default config) hands an expert weight a view off the 16-byte grid."""
    engine = _engine(_ExpertsAfterOddParam, 2)
    return engine.module.experts.data_ptr() % 16 != 0
