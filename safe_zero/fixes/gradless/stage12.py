"""ZeRO-1/2: the hooks and the epilogue of ``DeepSpeedZeroOptimizer`` through the planner (docs/rank_agreement.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from deepspeed import comm as dist
from torch._C import _current_graph_task_id

from safe_zero.fixes.gradless.adapter import WHY, WHY_NOT_USED, Gradless, PlannerAdapter
from safe_zero.fixes.gradless.gradients import zero_grads_for
from safe_zero.fixes.gradless.planner import FIRED
from safe_zero.patching import overrides

if TYPE_CHECKING:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as _Optimizer
else:
    _Optimizer = object


class ReduceInOneOrderStage12(PlannerAdapter, _Optimizer):
    """Mixin for ``DeepSpeedZeroOptimizer`` (ZeRO-1/2, every reduction route).

    ZeRO-2 (and ZeRO-1 with ``overlap_comm``) reduces in its gradient hooks, so they go through the planner, which
    may queue them while the first backward's agreement is in flight (the bucket reductions are a backward's only
    collectives). ZeRO-1 without ``overlap_comm`` reduces in one ordered pass that only needs the zeros.
    """

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start_planner(dist.get_world_size(group=self.dp_process_group), queues=True)

    def _reduced_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        for i, group in enumerate(self.bit16_groups):
            process_group = self.real_dp_process_group[i]
            by_group.setdefault(id(process_group), (process_group, []))[1].extend(
                p for p in group if p.requires_grad)
        return list(by_group.values())

    def _trainable_params(self) -> Iterable[torch.nn.Parameter]:
        return (p for group in self.bit16_groups for p in group if p.requires_grad)

    def _zero_fill(self, wanted: Iterable[tuple[torch.nn.Parameter, str]]) -> None:
        accum = self.use_grad_accum_attribute
        state = self._safe_zero
        assert state.gradless is not None  # the fix is on: only then are zeros filled
        zero_grads_for([(param, param.shape, param.device, why) for param, why in wanted
                        # earlier micro-steps left it a gradient
                        if not (accum and getattr(param, "grad_accum", None) is not None)],
                       state.gradless.zeroed, state.session)

    def _at_accumulation_boundary(self) -> bool:
        boundary = self.is_gradient_accumulation_boundary  # a method since 0.19, a flag before
        return bool(boundary() if callable(boundary) else boundary)

    def _stock_hook(self) -> Callable[..., None]:
        return super().process_gradients

    @overrides
    def process_gradients(self, param: torch.nn.Parameter, i: int) -> None:
        # Runs per parameter per step: while a backward walks the agreed order, an identity test against the
        # parameter the walk expects next, a task test and a step along the chain; a planner call for any other.
        planner: Gradless | None = self._safe_zero.gradless
        if planner is None:
            super().process_gradients(param, i)
            return
        step = planner.step
        # Planner.step's protocol: the next parameter of the agreed order, in the walk's autograd task (a nested
        # backward's hook goes to the planner, which stops there)
        if param is step[0] and _current_graph_task_id() == planner.wake_task:
            planner.step = planner.steps[step[2]]
            if param.grad is None:
                self._zero_fill(((param, WHY[FIRED]),))
            planner.stock_hook(param, i)
            if step[1]:  # the ones after it this rank's backward does not reach
                self._carry_out(step[1])
            return
        # The conditions of stock process_gradients / reduce_ready_partitions_and_remove_grads: else the hooks only
        # accumulate (or DeepSpeed's coalesce_grad_reduction defers them itself). Outside a backward (that flush)
        # there is no graph to ask, and DeepSpeed calls in parameter order on every rank anyway.
        if planner.routes and not getattr(self, "_coalesce_grad_reduction", False) \
                and (self.partition_gradients or self.overlap_comm and self._at_accumulation_boundary()):
            task = _current_graph_task_id()
            if task != -1:
                self._carry_out(planner.hook(param, (i,), task))
                return
        if param.grad is None:
            self._zero_fill(((param, WHY[FIRED]),))
        super().process_gradients(param, i)

    @overrides
    def reduce_gradients(self, pipeline_parallel: bool = False) -> None:
        # ZeRO-1 without overlap_comm reduces in one ordered pass here, skipping None gradients: fill them.
        if self._safe_zero.gradless is not None and not self.overlap_comm:
            self._zero_fill((param, WHY_NOT_USED) for group in self.bit16_groups for param in group
                            if param.requires_grad and self.get_gradient_for_reduction(param) is None)
        super().reduce_gradients(pipeline_parallel)

    @overrides
    def independent_gradient_partition_epilogue(self) -> None:
        self._finish_backward((param, (i,)) for i, group in enumerate(self.bit16_groups) for param in group)
        super().independent_gradient_partition_epilogue()
