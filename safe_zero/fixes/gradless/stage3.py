"""ZeRO-3: the hooks and the epilogue of ``DeepSpeedZeroOptimizer_Stage3`` through the planner, on the module
clock (docs/rank_agreement.md)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import z3_leaf_parameter

from safe_zero.fixes.gradless.adapter import WHY, PlannerAdapter
from safe_zero.fixes.gradless.collectives import zero_grads_for
from safe_zero.fixes.gradless.module_order import AgreesOnModulesWhileRecording, ModuleClock
from safe_zero.fixes.gradless.planner import FIRED, Mode
from safe_zero.patching import overrides


class ReduceInOneOrderStage3(PlannerAdapter):
    """Mixin for ``DeepSpeedZeroOptimizer_Stage3``: the same for parameters outside ZeRO-3 leaf modules (a leaf
    module's backward hook already reduces all of its parameters, zero-filled, in order), walked on the module
    clock of safe_zero's coordinator (``AgreesOnModulesWhileRecording``)."""

    #: The module clock this optimizer's walk follows (``None``: a stock coordinator, no walk on a clock).
    _safe_zero_clock: ModuleClock | None = None

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        coordinator = self.parameter_offload.get_param_coordinator()
        if isinstance(coordinator, AgreesOnModulesWhileRecording):
            self._safe_zero_clock = coordinator.module_clock
        planner = self._start_planner(dist.get_world_size(group=self.dp_process_group),
                                      clocked=self._safe_zero_clock is not None, queues=False)
        if planner is not None and planner.mode is Mode.AGREED and self._safe_zero_clock is not None:
            self._safe_zero_clock.follow(planner, self._at_module_boundary)

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
        return self._safe_zero_clock is not None and self._safe_zero_clock.recorded()

    def _zero_fill(self, wanted: Iterable[tuple[torch.nn.Parameter, str]]) -> None:
        # The parameter may already be re-partitioned here: size the gradient from ds_shape.
        device = get_accelerator().current_device_name()
        zero_grads_for(self, [(param, param.ds_shape, device, why) for param, why in wanted])

    def _stock_hook(self) -> Callable[..., None]:
        return super().reduce_ready_partitions_and_remove_grads

    def _at_module_boundary(self, clock: int, task: int) -> None:
        """Called by the module clock where the backward enters a module and the planner may hand over there."""
        if not getattr(self, "_coalesce_grad_reduction", False):
            self._carry_out(self._safe_zero_planner.boundary(clock, task))

    @overrides
    def reduce_ready_partitions_and_remove_grads(self, param: torch.nn.Parameter, *args: Any) -> None:
        # Runs per parameter per step: while a backward walks the agreed order, an identity test against the
        # parameter the walk expects next, a clock test and a step along the chain; a planner call for any other.
        planner = self._safe_zero_planner
        if planner is None:
            super().reduce_ready_partitions_and_remove_grads(param, *args)
            return
        # planner.carry_out, inlined: the next parameter of the agreed order, its last hook of this backward, due
        # (on the module clock: a stock coordinator has none, and the planner's hook decides).
        clock = self._safe_zero_clock
        step = planner.step
        if param is step[0] and clock is not None and clock.position >= step[1] \
                and getattr(param, "ds_grad_is_ready", True):
            planner.step = following = planner.steps[step[2]]
            planner.wake_at = following[1]
            if param.grad is None:
                self._zero_fill(((param, WHY[FIRED]),))
            self._safe_zero_stock_hook(param, *args)
            return
        # DeepSpeed's coalesce_grad_reduction flush calls this outside any backward: no graph to ask there, and
        # DeepSpeed calls in parameter order on every rank anyway.
        if planner.routes and not getattr(self, "_coalesce_grad_reduction", False):
            task = torch._C._current_graph_task_id()
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
