"""grouped_mm expert weights off the 16-byte grid in flat buffers DeepSpeed does not pad (every release).

``FP16_Optimizer`` (fused stage 0), ``BF16_Optimizer`` (ZeRO-1 + bf16 + fp32 gradient
accumulation) and, before 0.19.7, ``DeepSpeedZeroOptimizer`` (ZeRO-1/2) concatenate each
parameter group into one flat buffer and rebind every parameter to its slice. A parameter whose
byte size is not a multiple of 16 (GPT-OSS's 2-element attention sinks, a 4-element router
bias) pushes every later slice off the 16-byte grid, and CUDA grouped_mm then refuses the expert
weights ("expected data_ptr to be aligned to 16 bytes").

Where the stock order leaves a grouped_mm weight off the grid (and only there: elsewhere the layout
and the checkpoints stay stock's), the fix orders its group before DeepSpeed flattens it: every
parameter whose size is a whole number of 16-byte units first (in their original order), then
the rest. The buffer starts on the grid, so each weight of that prefix does too, with no padding
at all: the buffers keep their size, the views stay zero-copy, and nothing in DeepSpeed's offset
arithmetic changes. Adam and SGD act element-wise, so the losses are bit-identical to the stock
order. DeepSpeed records the flattened order itself (``bf16_groups``, ``round_robin_bit16_groups``,
``fp16_groups``): checkpoints and ``zero_to_fp32`` follow it, and the order is a pure function of the
model, so a resumed run loads its own checkpoint. A checkpoint written in the other order (stock's,
or safe_zero's under stock) is laid out again on load, exactly, or refused with the universal-checkpoint
command where it cannot be mapped: ``safe_zero.checkpoint_layout``, whose mixins are bases of these. Stock
DeepSpeed knows nothing of the order, so a reordered safe_zero checkpoint moves to stock through a
universal checkpoint (``ds_to_universal``, which maps every parameter by name).

CUDA grouped_mm also needs 16-byte row strides, so its weights are whole 16-byte units in
practice; one that is not is placed first after the prefix (still aligned), and a group with two
such weights cannot be laid out without padding: that is refused at initialize with the
configurations that work.

The guard mixin (``"alignment_guard"``, on by default) checks the detected weights after
initialize and after every optimizer step on every flattening wrapper, including the ZeRO-1/2
route that DeepSpeed >= 0.19.7 pads itself, and on ZeRO-3 after every gather.

ZeRO-3, measured on CPU (bf16, a 3-element parameter ahead of the expert weight, forward and
backward alike): at world size 1 every gather path (persistent, coalesced, single, all-reduce,
offload_param) hands grouped_mm the rank's own partition, a view into the optimizer's flat buffer,
14 bytes off the grid; at world size >= 2 the all-gather paths (persistent, coalesced, single,
offload_param, ``GatheredParameters``) build fresh buffers and are aligned whatever the partition
sizes (measured at 2, 3 and 4 ranks for DeepSeek-V3, GPT-OSS, Qwen3-MoE and OLMoE, where a
partition is rarely a whole number of 16-byte units), while ``stage3_use_all_reduce_for_fetch_params``
is 8 bytes off (0.19.8) or 6 (0.18.9). ``AlignStage3SubGroups`` therefore reorders only where a rank
holds whole parameters (a partition group of one), so at world size >= 2 the layout, and the
checkpoint, is stock's; ``AlignAllReduceFetch`` pads the all-reduce buffer; the all-reduce fetch of
DeepSpeed < 0.19.8 packs parameters without any slack and is refused at initialize instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch
from packaging.specifiers import SpecifierSet

from safe_zero.alignment import ALIGNMENT_BYTES, AlignmentPlan, plan_for, round_up
from safe_zero.checkpoint_layout import LoadsUnpaddedCheckpoints  # noqa: F401  (re-exported for wrappers.py)
from safe_zero.checkpoint_layout import RecordsFlatOrder, RelaysByName
from safe_zero.errors import AlignmentError
from safe_zero.fix import Fix
from safe_zero.patching import overrides, pass_through, stock_class
from safe_zero.session import Session, State, session_for, state_of

if TYPE_CHECKING:
    # mypy reads each mixin as the DeepSpeed class it is put before (untyped: its attributes are Any); at run time a
    # mixin subclasses nothing (docs/developing.md, "A new fix"). The flattening wrappers' mixins extend
    # RecordsFlatOrder, read as their common base.
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as _Offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as _Coordinator

    from safe_zero.zero_types import ZeROParameter
else:
    _Offload = _Coordinator = object

#: A parameter, or (ZeRO-3) a partitioned one.
_Param = TypeVar("_Param", bound=torch.Tensor)

FIX = Fix(
    name="grouped_mm_alignment",
    summary="keep grouped_mm expert weights 16-byte aligned in the flat buffers DeepSpeed does not pad",
    needed_on=SpecifierSet(">=0.18.0"),
    probe="safe_zero.probes:probe_grouped_mm_alignment",
)


def _nbytes(param: torch.Tensor) -> int:
    # ZeRO-1/2 flattening on CPU parks the data in cpu_data and leaves a 1-element placeholder.
    data = getattr(param, "cpu_data", param)
    return data.numel() * data.element_size()


def _partition_nbytes(param: ZeROParameter) -> int:
    return param.partition_numel() * param.element_size()  # ZeRO-3: what the optimizer's flat buffer holds


def _aligned_order(params: Sequence[_Param], plan: AlignmentPlan, route: str,
                   nbytes: Callable[[_Param], int] = _nbytes, keep_aligned: bool = True) -> list[int]:
    """Positions of ``params`` in an order that puts every detected weight on the grid (raises if impossible);
    with ``keep_aligned``, the given order wherever it already does."""
    size = [nbytes(p) for p in params]
    if keep_aligned and _stock_order_aligned(params, size, plan):
        return list(range(len(params)))  # stock's layout already serves grouped_mm: keep it (and its checkpoints)
    whole = [i for i, s in enumerate(size) if s % ALIGNMENT_BYTES == 0]
    rest = [i for i, s in enumerate(size) if s % ALIGNMENT_BYTES != 0]
    partial = [i for i in rest if plan.needs(params[i])]
    if len(partial) > 1:
        listed = ", ".join(f"{plan.name(params[i])} ({size[i]} bytes)" for i in partial)
        raise AlignmentError(
            f"safe_zero cannot keep these grouped_mm weights 16-byte aligned on the {route} route: {listed}. "
            "Their sizes are not multiples of 16 bytes and this route has no padding between parameters. "
            "ZeRO-1/2 with bf16/fp16 and no fp32 gradient accumulation on DeepSpeed >= 0.19.7 pads any size "
            "(zero_optimization.parameter_alignment, which safe_zero turns on).")
    return whole + partial + [i for i in rest if i not in partial]


def _stock_order_aligned(params: Sequence[torch.Tensor], size: list[int], plan: AlignmentPlan) -> bool:
    """Whether the stock order already starts every weight that needs the grid on it (with ``everything``: every
    parameter whose size is a whole number of 16-byte units)."""
    offset = 0
    for param, nbytes in zip(params, size):
        wanted = plan.needs(param) or (plan.everything and nbytes % ALIGNMENT_BYTES == 0)
        if wanted and offset % ALIGNMENT_BYTES:
            return False
        offset += nbytes
    return True


def _reorder(group: list[Any], order: list[int]) -> list[Any]:
    return [group[i] for i in order]


def _wants(plan: AlignmentPlan, session: Session, params: Sequence[torch.Tensor]) -> bool:
    return plan.active and session.uses(FIX) and (plan.everything or any(plan.needs(p) for p in params))


class AlignFlatGroups(RecordsFlatOrder):
    """Mixin for the flattening wrappers: orders the groups before DeepSpeed flattens them, then checks.

    ``parameter_alignment=True`` (ZeRO-1/2 on DeepSpeed >= 0.19.7) means DeepSpeed pads itself;
    the mixin then only guards.
    """

    @overrides
    def __init__(self, init_optimizer: Any, *args: Any, **kwargs: Any) -> None:
        session = session_for(self)
        plan = plan_for(session)
        route = stock_class(type(self)).__name__
        if plan.active and kwargs.get("parameter_alignment", False):
            session.engaged(FIX, f"{route}: DeepSpeed pads parameter boundaries "
                                 "(zero_optimization.parameter_alignment) "
                                 f"for {len(plan.params)} grouped_mm weight(s)")
        elif plan.active and init_optimizer is not None:
            moved = 0
            for index, group in enumerate(init_optimizer.param_groups):
                params = list(group["params"])
                if not _wants(plan, session, params):
                    continue
                order = _aligned_order(params, plan, route)
                if order != sorted(order):
                    group["params"] = _reorder(params, order)
                    self._record_flat_order(index, order)
                    moved += sum(1 for new, old in enumerate(order) if new != old)
            if moved:
                session.engaged(FIX, f"{route}: flattened whole-16-byte parameters first ({moved} moved) "
                                     f"so {len(plan.params)} grouped_mm weight(s) sit on the 16-byte grid")
        super().__init__(init_optimizer, *args, **kwargs)
        plan.check("after initialize", route)

    @overrides
    def step(self, *args: Any, **kwargs: Any) -> Any:
        result = super().step(*args, **kwargs)
        plan_for(session_for(self)).check("after an optimizer step", stock_class(type(self)).__name__)
        return result


class AlignRoundRobinGroups(AlignFlatGroups, RelaysByName):
    """Mixin for ``DeepSpeedZeroOptimizer``: ``round_robin_gradients`` reshuffles after the group order; re-apply it.

    A checkpoint in another flat layout is laid out again by name (``RelaysByName``).
    """

    @overrides
    def _round_robin_reorder(self, tensor_list: list[Any], num_partitions: int) -> tuple[list[Any], Any]:
        tensors, indices = super()._round_robin_reorder(tensor_list, num_partitions)
        index = self._next_flat_group()
        session = session_for(self)
        plan = plan_for(session)
        if getattr(self, "parameter_alignment", False) or not _wants(plan, session, tensors):
            return tensors, indices
        # Always whole units first here: keeping an already aligned round-robin order after the group reorder
        # left safe_get_full_fp32_param wrong on 0.18.9 at 2 ranks (not investigated further); whole-first is right.
        order = _aligned_order(tensors, plan, "DeepSpeedZeroOptimizer (round_robin_gradients)", keep_aligned=False)
        if order != sorted(order):
            self._record_flat_order(index, order)
        position = {old: new for new, old in enumerate(order)}
        return _reorder(tensors, order), {original: position[at] for original, at in indices.items()}


class AlignStage3SubGroups(RecordsFlatOrder):
    """Mixin for ``DeepSpeedZeroOptimizer_Stage3``: where a rank holds a whole parameter (world size 1, or a
    partition group of one), the gathered weight IS its partition, a view into the optimizer's flat lp buffer.
    Order each parameter group whole-16-byte partitions first before DeepSpeed cuts it into sub-groups.

    With a partition group of two or more, every gather builds a fresh buffer, so the stock order stays: no
    partition size has to be a whole number of 16-byte units (at 3 ranks they rarely are), and the flat
    buffers, hence the checkpoints, are exactly stock's.

    The buffer holds the groups back to back, so a weight in a later parameter group is on the grid only if
    the groups before it are whole 16-byte units; the guard reports it otherwise.
    """

    def _holds_whole_params(self) -> bool:
        return self.partition_count == 1

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        session = session_for(self)
        plan = plan_for(session)
        if plan.guard and self._holds_whole_params():  # grouped_mm will get the partition itself: check it now
            for sub_group in self.fp16_groups:
                for param in sub_group:
                    held = param.ds_tensor
                    if (plan.needs(param) and held.numel() >= param.ds_numel
                            and held.data_ptr() % ALIGNMENT_BYTES):
                        why = ("the optimizer parameter groups before it end off the grid in DeepSpeed's flat "
                               "buffer. Put the grouped_mm weights in the first parameter group, or use ZeRO-1/2."
                               if session.uses(FIX) else
                               'the grouped_mm_alignment fix is off; set it to "auto" to align it.')
                        raise AlignmentError(
                            f"safe_zero cannot keep grouped_mm weight {plan.name(param)} 16-byte aligned on ZeRO-3 "
                            f"(data_ptr % 16 = {held.data_ptr() % ALIGNMENT_BYTES}): {why}")

    @overrides
    def _create_fp16_sub_groups(self, params_group: list[Any]) -> list[list[Any]]:
        index = self._next_flat_group()
        session = session_for(self)
        plan = plan_for(session)
        params_group = list(params_group)
        if self._holds_whole_params() and _wants(plan, session, params_group):
            order = _aligned_order(params_group, plan, "DeepSpeedZeroOptimizer_Stage3", nbytes=_partition_nbytes)
            if order != sorted(order):
                params_group = _reorder(params_group, order)
                self._record_flat_order(index, order)
                session.engaged(FIX, "DeepSpeedZeroOptimizer_Stage3: flattened whole-16-byte partitions first")
        return super()._create_fp16_sub_groups(params_group)


class AlignAllReduceFetch(_Offload):
    """Mixin for ``DeepSpeedZeRoOffload``: ``stage3_use_all_reduce_for_fetch_params`` gathers a module's
    parameters into one buffer at offsets that add up ``ds_numel_aligned`` (the size rounded to the world
    size), so a weight after a 3-element parameter lands 8 bytes off the grid. Rounding every
    ``ds_numel_aligned`` up to whole 16-byte units puts each one on the grid; the value is read by that
    path alone, and the extra zeros (< 16 bytes per parameter) live only in the transient gather buffer.
    """

    @overrides
    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        session = session_for(self)
        plan = plan_for(session)
        params = [p for p in module.parameters() if hasattr(p, "ds_numel_aligned")]
        if _wants(plan, session, params):
            bumped = 0
            for param in params:
                grid = max(1, ALIGNMENT_BYTES // param.element_size())
                aligned = round_up(param.ds_numel_aligned, grid)
                bumped += aligned != param.ds_numel_aligned
                param.ds_numel_aligned = aligned
            if bumped:
                session.engaged(FIX, f"DeepSpeedZeRoOffload: {bumped} all-reduce fetch slot(s) rounded to 16 bytes")


class GuardGatheredAlignment(_Coordinator):
    """Mixin for ``PartitionedParameterCoordinator``: once a module's parameters are gathered, check the
    detected weights among them (the ZeRO-3 half of the ``alignment_guard``)."""

    _safe_zero: State

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # This fix's part of the coordinator's State, module id -> its detected weights: fetches run per submodule
        # per step, so look once.
        guarded: dict[int, tuple[torch.nn.Parameter, ...]] = {}
        state_of(self).grouped_mm = guarded
        super().__init__(*args, **kwargs)
        plan = plan_for(session_for(self))
        if not (plan.guard and plan.params):  # nothing to check: skip this override at every module entry
            pass_through(self, "fetch_sub_module", GuardGatheredAlignment)

    @overrides
    def fetch_sub_module(self, current_submodule: torch.nn.Module, forward: bool) -> None:
        super().fetch_sub_module(current_submodule, forward)
        by_module = self._safe_zero.grouped_mm
        assert by_module is not None  # set in __init__
        guarded = by_module.get(id(current_submodule))
        if guarded is None:
            guarded = by_module[id(current_submodule)] = self._guarded(current_submodule)
        for param in guarded:
            if param.numel() and param.data_ptr() % ALIGNMENT_BYTES:
                raise AlignmentError(
                    f"safe_zero alignment guard: grouped_mm weight {plan_for(session_for(self)).name(param)} was "
                    f"gathered {param.data_ptr() % ALIGNMENT_BYTES} bytes off the 16-byte grid by ZeRO-3. CUDA "
                    "grouped_mm would fail with 'expected data_ptr to be aligned to 16 bytes'. Put the grouped_mm "
                    "weights in the first optimizer parameter group, or use ZeRO-1/2.")

    def _guarded(self, module: torch.nn.Module) -> tuple[torch.nn.Parameter, ...]:
        """The detected grouped_mm weights of ``module`` (none when the alignment guard is off)."""
        plan = plan_for(session_for(self))
        if not plan.guard:
            return ()
        return tuple(p for p in module.parameters(recurse=False) if plan.needs(p))


__all__ = ["AlignAllReduceFetch", "AlignFlatGroups", "AlignRoundRobinGroups", "AlignStage3SubGroups", "FIX",
           "GuardGatheredAlignment", "LoadsUnpaddedCheckpoints"]
