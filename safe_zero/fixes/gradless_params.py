"""Trainable parameters that get no gradient (every DeepSpeed release up to 0.19.8).

A parameter with ``requires_grad=True`` whose autograd function returns ``None`` for it
(FP-Quant's ``dqweight`` in pseudo-quantization without master weights) still fires its
post-accumulate-grad hook. ZeRO-2 then reads ``param.grad.view`` (``AttributeError:
'NoneType' object has no attribute 'view'``) and ZeRO-3 ``param.grad.numel()`` in
``__add_grad_to_ipg_bucket``. ZeRO-1 only reduces at the step and copes.

The fix hands such a parameter a zero gradient right before DeepSpeed's hook body reads it,
the way DDP treats unused parameters. Every rank then puts the same parameters into the same
buckets, so the collectives stay matched even when only some ranks saw ``None``.

What happens to the value: a zero gradient leaves it bit-identical under Adam/AdamW without
weight decay and under SGD without weight decay (Adam's update is ``0 / (0 + eps) = 0``).
Decoupled weight decay still applies to it, as to any parameter in its group: put such
parameters in a param group with ``weight_decay=0`` (or freeze them) if they must not decay.
"""

from __future__ import annotations

from typing import Any

import torch
from packaging.specifiers import SpecifierSet

from safe_zero.fixes._base import Fix
from safe_zero.session import session_for

FIX = Fix(
    name="gradless_params",
    summary="give trainable parameters that autograd left without a gradient a zero gradient (ZeRO-2/3)",
    needed_on=SpecifierSet(">=0.18.0"),
)


def _fill_missing_grad(wrapper: Any, param: torch.nn.Parameter, shape: torch.Size, device: Any) -> None:
    if param.requires_grad:
        param.grad = torch.zeros(shape, dtype=param.dtype, device=device)
        session = session_for(wrapper)
        if not getattr(param, "_safe_zero_gradless_reported", False):
            session.engaged(FIX, f"parameter of shape {tuple(shape)} had no gradient; reduced as zeros")
            param._safe_zero_gradless_reported = True


class ZeroFillMissingGradsStage12:
    """Mixin for ``DeepSpeedZeroOptimizer``: fills the gradient in the per-parameter hook body."""

    def process_gradients(self, param: torch.nn.Parameter, i: int) -> None:
        # Runs per parameter per step: the cheap test first.
        if param.grad is None and session_for(self).uses(FIX):
            _fill_missing_grad(self, param, param.shape, param.device)
        super().process_gradients(param, i)


class ZeroFillMissingGradsStage3:
    """Mixin for ``DeepSpeedZeroOptimizer_Stage3``: fills the gradient in the per-parameter hook body."""

    def reduce_ready_partitions_and_remove_grads(self, param: torch.nn.Parameter, *args: Any) -> None:
        if param.grad is None and session_for(self).uses(FIX):
            # The parameter may already be re-partitioned here: size the gradient from ds_shape.
            from deepspeed.accelerator import get_accelerator
            _fill_missing_grad(self, param, param.ds_shape, get_accelerator().current_device_name())
        super().reduce_ready_partitions_and_remove_grads(param, *args)
