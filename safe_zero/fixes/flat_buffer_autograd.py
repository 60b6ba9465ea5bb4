"""ZeRO-1/2 flat parameter buffers built with autograd history (DeepSpeed 0.18.7 - 0.18.x).

DeepSpeed 0.18.7 started flattening each ZeRO-1/2 parameter group straight from the
trainable parameters when the device has room (``flatten_on_gpu``, always true on the CPU
accelerator), so ``bit16_groups_flat`` comes out of ``torch.cat`` with ``requires_grad=True``
and a ``CatBackward0`` node. The per-rank partitions are views of it, and the all-gather
after every step writes into it in place; on gloo (the CPU backend) ``all_gather_into_tensor``
does that through ``split`` views and autograd refuses: ``RuntimeError: Output 0 of Split is
a view and is being modified inplace``, at world size >= 2, on every model. DeepSpeed 0.19.0
detaches the buffer; this fix does the same on the releases that need it.

Nothing needs that history: the parameters are rebound to the buffer through ``.data``
(which drops autograd anyway), gradients reach DeepSpeed through per-parameter hooks, and the
fp32 master partition is a detached clone. Detaching only stops the buffer from pinning a
graph node; its storage, and so every parameter view of it, is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from packaging.specifiers import SpecifierSet

from safe_zero.fix import Fix
from safe_zero.patching import overrides
from safe_zero.session import session_for

if TYPE_CHECKING:
    # mypy reads the mixin as the DeepSpeed class it is put before (untyped: its attributes are Any); at run time a
    # mixin subclasses nothing (docs/developing.md, "A new fix").
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as _ZeroOptimizer
else:
    _ZeroOptimizer = object

FIX = Fix(
    name="flat_buffer_autograd",
    summary="build the ZeRO-1/2 flat parameter buffers without autograd history (gloo all-gather)",
    needed_on=SpecifierSet(">=0.18.7,<0.19"),
    probe="safe_zero.probes:probe_flat_buffer_autograd",
)


class DetachFlatBuffers(_ZeroOptimizer):
    """Mixin for ``DeepSpeedZeroOptimizer``: detaches what its flatten helper returns.

    The helper also flattens gradients and checkpoint partitions; those carry no history, so
    only the parameter buffers are changed (and reported).
    """

    @overrides
    def flatten_dense_tensors_aligned(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        flat = super().flatten_dense_tensors_aligned(*args, **kwargs)
        if flat.requires_grad and session_for(self).uses(FIX):
            session_for(self).engaged(FIX, f"flat buffer of {flat.numel()} elements built without autograd history")
            return flat.detach()
        return flat
