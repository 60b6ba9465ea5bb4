"""ZeRO-3: the hooks and the epilogue of ``DeepSpeedZeroOptimizer_Stage3`` through the planner, on the module
clock (docs/rank_agreement.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import z3_leaf_parameter
from torch._C import _current_graph_task_id

from safe_zero.fixes.gradless.adapter import WHY, Gradless, PlannerAdapter
from safe_zero.fixes.gradless.gradients import zero_grads_for
from safe_zero.fixes.gradless.module_order import AgreesOnModulesWhileRecording
from safe_zero.fixes.gradless.planner import FIRED
from safe_zero.patching import overrides

if TYPE_CHECKING:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as _Optimizer
else:
    _Optimizer = object


class ReduceInOneOrderStage3(PlannerAdapter, _Optimizer):
    """Mixin for ``DeepSpeedZeroOptimizer_Stage3``: the same for parameters outside ZeRO-3 leaf modules (a leaf
    module's backward hook already reduces all of its parameters, zero-filled, in order), walked on the module
    clock of safe_zero's coordinator (``AgreesOnModulesWhileRecording``)."""

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The walk follows the module clock of safe_zero's coordinator (a stock one has none: no walk on a clock).
        coordinator = self.parameter_offload.get_param_coordinator()
        order = coordinator._safe_zero.module_order if isinstance(coordinator, AgreesOnModulesWhileRecording) else None
        clock = order.clock if order is not None else None
        self._start_planner(dist.get_world_size(group=self.dp_process_group), queues=False, clock=clock)

    def _reduced_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        params = [p for group in self.fp16_groups for p in group if p.requires_grad and not z3_leaf_parameter(p)]
        return [(self.dp_process_group, params)]

    def _ordered_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        # Leaf-module parameters keep their place too: their hook hands them over between the others'.
        return [(self.dp_process_group, list(self._trainable_params()))]

    def _trainable_params(self) -> Iterable[torch.nn.Parameter]:
        # Leaf-module parameters too: a leaf module some rank never entered has no gradient there either.
        return (p for group in self.fp16_groups for p in group if p.requires_grad)

    def _walkable(self) -> bool:
        # A trace left during this step: the next one records the module order again, and agrees again.
        planner = self._safe_zero.gradless
        return planner is not None and planner.clock is not None and planner.clock.followed

    def _zero_fill(self, wanted: Iterable[tuple[torch.nn.Parameter, str]]) -> None:
        # The parameter may already be re-partitioned here: size the gradient from ds_shape.
        device = get_accelerator().current_device_name()
        state = self._safe_zero
        assert state.gradless is not None  # the fix is on: only then are zeros filled
        # A ZeRO-3 parameter (zero_types.ZeROParameter); the signature is the stages' common one.
        zero_grads_for([(param, param.ds_shape, device, why) for param, why in wanted],  # type: ignore[attr-defined]
                       state.gradless.zeroed, state.session)

    def _stock_hook(self) -> Callable[..., None]:
        return super().reduce_ready_partitions_and_remove_grads

    @overrides
    def reduce_ready_partitions_and_remove_grads(self, param: torch.nn.Parameter, *args: Any) -> None:
        # Runs per parameter per step: while a backward walks the agreed order, an identity test against the
        # parameter the walk expects next, a clock test and a step along the chain; a planner call for any other.
        planner: Gradless | None = self._safe_zero.gradless
        if planner is None:
            super().reduce_ready_partitions_and_remove_grads(param, *args)
            return
        # Planner.step's protocol: the next parameter of the agreed order, its last hook of this backward, due (on
        # the module clock: a stock coordinator has none, and the planner's hook decides).
        clock = planner.clock
        step = planner.step
        if param is step[0] and clock is not None and clock.position >= step[1] \
                and getattr(param, "ds_grad_is_ready", True):
            planner.step = following = planner.steps[step[2]]
            planner.wake_at = following[1]
            if param.grad is None:
                self._zero_fill(((param, WHY[FIRED]),))
            planner.stock_hook(param, *args)
            return
        # DeepSpeed's coalesce_grad_reduction flush calls this outside any backward: no graph to ask there, and
        # DeepSpeed calls in parameter order on every rank anyway.
        if planner.routes and not getattr(self, "_coalesce_grad_reduction", False):
            task = _current_graph_task_id()
            if task != -1:
                # ds_grad_is_ready False (tiled compute): one of several hooks of this parameter in this backward;
                # DeepSpeed buckets only the last one, so that one is what keeps its place in the order.
                self._carry_out(planner.hook(param, args, task, None if clock is None else clock.position,
                                             getattr(param, "ds_grad_is_ready", True)))
                return
        if param.grad is None:
            self._zero_fill(((param, WHY[FIRED]),))
        super().reduce_ready_partitions_and_remove_grads(param, *args)

    @overrides
    def independent_gradient_partition_epilogue(self) -> None:
        self._finish_backward((param, ()) for group in self.fp16_groups for param in group)
        super().independent_gradient_partition_epilogue()
