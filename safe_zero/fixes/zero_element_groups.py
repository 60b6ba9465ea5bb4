"""Zero-element parameters inside the optimizer wrappers' flat groups (DeepSpeed < 0.19.8).

Every wrapper that flattens its parameter groups (``FP16_Optimizer``, ``BF16_Optimizer``,
``DeepSpeedZeroOptimizer``) used to take zero-element trainable parameters into its flat
buffers. That fails three ways, depending on the release and the torch build: rebinding the
parameter to its slice loses its shape (``(0, 8)`` -> ``(0,)``, where torch's
``unflatten_dense_tensors`` returns ``zeros({0})``; fp16/bf16 wrappers < 0.19.8, ZeRO-1/2
< 0.19.7), ZeRO-1/2 gradient reduction raises ``KeyError`` in ``average_tensor`` (< 0.19.6),
and ZeRO-1/2 HP-fragment mapping asserts ``fragment start N should be < fragment_end N`` when
the parameter sits inside a rank's partition, as FP-Quant's placeholders do (< 0.19.6).
DeepSpeed 0.19.8 fixed all of it by leaving such parameters out of every optimizer group
(``is_optimized_parameter``); this fix does the same on older releases.

A zero-element parameter has nothing to optimize, so leaving it out loses no state. The
module's ``state_dict``, and so ``save_checkpoint``/``load_checkpoint``, still carry it with
its shape. DeepSpeed's ``zero_to_fp32`` leaves it out of the consolidated state dict (as stock
0.19.8 does at ZeRO-1); ``safe_zero.get_fp32_state_dict_from_zero_checkpoint`` puts it back with
its real shape, from the module state saved beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from packaging.specifiers import SpecifierSet

from safe_zero.fix import Fix
from safe_zero.patching import overrides
from safe_zero.session import session_for

if TYPE_CHECKING:
    # mypy reads the mixin as the DeepSpeed class it is put before (untyped: its attributes are Any): here the common
    # base of the flattening wrappers. At run time a mixin subclasses nothing (docs/developing.md, "A new fix").
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer as _Optimizer
else:
    _Optimizer = object

FIX = Fix(
    name="zero_element_groups",
    summary="keep zero-element parameters out of the fp16/bf16/ZeRO-1/2 flat groups",
    needed_on=SpecifierSet("<0.19.8"),
    probe="safe_zero.probes:probe_zero_element_groups",
)


def drop_zero_element_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """Remove zero-element trainable parameters from ``optimizer``'s groups; return them."""
    dropped: list[torch.nn.Parameter] = []
    for group in optimizer.param_groups:
        kept: list[torch.nn.Parameter] = []
        for param in group["params"]:
            (dropped if param.requires_grad and param.numel() == 0 else kept).append(param)
        group["params"] = kept
    return dropped


class ExcludeZeroElementParams(_Optimizer):
    """Mixin for the flattening wrappers: filters the groups before DeepSpeed flattens them."""

    @overrides
    def __init__(self, init_optimizer: Any, *args: Any, **kwargs: Any) -> None:
        session = session_for(self)
        if session.uses(FIX) and init_optimizer is not None:
            dropped = drop_zero_element_params(init_optimizer)
            if dropped:
                session.engaged(FIX, f"{len(dropped)} zero-element parameter(s) kept out of {type(self).__name__}")
        super().__init__(init_optimizer, *args, **kwargs)
