"""ZeRO-3's coordinator hooks of the module-order protocol (``order.ModuleOrder``), and the parameter manager's and
the parameter dictionaries' (docs/rank_agreement.md): modules some ranks skip kept gathered, MoE blocks gathered
whole, reads outside a module's entry agreed on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, cast

import torch
from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import set_z3_leaf_module, z3_leaf_module
from torch import nn

from safe_zero.fixes.gradless import FIX
from safe_zero.fixes.gradless.order import AGREED_ENTRIES, ModuleOrder, TracePhase
from safe_zero.fixes.gradless.shadow import FETCH, Event
from safe_zero.leaf_modules import experts_beside_root, moe_blocks, optional_modules
from safe_zero.options import zero_stage
from safe_zero.patching import calls, overrides, pass_through
from safe_zero.session import Session, State, session_for, state_of

if TYPE_CHECKING:
    # mypy reads each mixin as the DeepSpeed class it is put before (untyped: its attributes are Any); at run time a
    # mixin subclasses nothing (docs/developing.md, "A new fix").
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as _Offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as _Coordinator

    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict as _Parameters

    from safe_zero.fixes.gradless.order import Coordinator
    from safe_zero.zero_types import ZeROModule
else:
    _Offload = _Coordinator = _Parameters = object


def blocks_to_gather_whole(model: Any, config: dict[str, Any] | None, session: Session) -> dict[str, nn.Module]:
    """The MoE blocks of a ZeRO-3 model that are not leaf modules yet (none when the ``gradless_params`` fix is off)."""
    if zero_stage(config) != 3 or not isinstance(model, nn.Module) or not session.uses(FIX):
        return {}
    options = session.options.leaf_modules
    blocks = moe_blocks(model, options.get("add", ()), options.get("remove", ()))
    return {name: module for name, module in blocks.items() if not z3_leaf_module(module)}


def make_leaves(blocks: dict[str, nn.Module], session: Session) -> None:
    """Mark ``blocks`` as ZeRO-3 leaf modules and report them."""
    for module in blocks.values():
        set_z3_leaf_module(module, True)
    if blocks:
        classes = sorted({type(m).__name__ for m in blocks.values()})
        session.engaged(FIX, f"{len(blocks)} MoE block(s) gathered whole as ZeRO-3 leaf modules ({', '.join(classes)})")


@calls("get_param_coordinator")
class KeepsOptionalModulesGathered(_Offload):
    """Mixin for ``DeepSpeedZeRoOffload``: modules some ranks skip stay gathered on every rank.

    Their parameters join DeepSpeed's persistent parameters, which the optimizer gathers again after
    every step and checkpoint (``stage3.py`` ``_post_step``, ``checkpoint_event_epilogue``); the
    coordinator leaves their modules out of the trace and gathers them at the start of a forward where
    anything else released them. Kept from the start: the ``"optional_modules"`` and an ``experts``
    ``nn.ModuleList`` beside the model's root (its router makes each rank call other experts, and the root
    cannot be gathered whole as an MoE block is). Found later: what the coordinator finds ranks skip while
    DeepSpeed records the module order.
    """

    @overrides
    def __init__(self, module: ZeROModule, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        session = session_for(self)
        if not session.uses(FIX):
            return
        coordinator = self.get_param_coordinator()
        if not isinstance(coordinator, AgreesOnModulesWhileRecording):
            return
        order = coordinator._safe_zero.module_order
        assert order is not None  # the coordinator's __init__ made it
        order.know_model(module, self.persistent_parameters, session.options.find_optional_modules)
        listed = cast("dict[str, ZeROModule]", optional_modules(module, session.options.optional_modules))
        experts = {name: cast("ZeROModule", m) for name, m in experts_beside_root(module).items()
                   if not _inside_any(name, listed)}
        if listed:
            order.keep_gathered(listed, "listed in optional_modules")
        if experts:
            order.keep_gathered(experts, "experts beside the model's root, which each rank routes differently")


def _inside_any(name: str, outer: Iterable[str]) -> bool:
    return any(name == o or name.startswith(f"{o}.") for o in outer)


class AgreesBeforeReadingAParameter(_Parameters):
    """Mixin for DeepSpeed's ``ZeROOrderedDict`` (a module's ``_parameters`` under ZeRO-3): a parameter read in a
    forward while it is not gathered, outside its module's entry (Qwen2-VL's ``self.proj.weight.dtype`` before calling
    ``self.proj``), is one DeepSpeed gathers on the reading rank alone. While the ranks record the module order they
    agree on it first (``ModuleOrder.agree_on_read``). The model's dictionaries take this class for recording forwards
    only (:func:`_watch_reads`): every other read costs nothing. ``_safe_zero``: the coordinator's state."""

    _safe_zero: State

    @overrides
    def __getitem__(self, key: str) -> Any:
        param: Any = dict.__getitem__(self, key)
        order = self._safe_zero.module_order
        assert order is not None  # given with the coordinator's state (_watch_reads)
        status = getattr(param, "ds_status", None)
        if self._in_forward and (status == ZeroParamStatus.NOT_AVAILABLE
                                 or (order.inside and status == ZeroParamStatus.AVAILABLE)):
            order.agree_on_read(self._parent_module, param)
        return super().__getitem__(key)


class SafeZeROOrderedDict(AgreesBeforeReadingAParameter, ZeROOrderedDict):
    """``ZeROOrderedDict`` that agrees before a read gathers, for recording forwards."""


def _watch_reads(dicts: list[Any], state: State | None) -> None:
    """Give the model's parameter dictionaries the class that agrees on reads (with the coordinator's ``state``), or
    DeepSpeed's back (``None``): the same instances, so DeepSpeed's own state on them stays."""
    klass = ZeROOrderedDict if state is None else SafeZeROOrderedDict
    if dicts and type(dicts[0]) is not klass:
        for params in dicts:
            params.__class__ = klass
            params._safe_zero = state


@calls("is_record_trace", "is_complete_trace", "is_invalid_trace")
class AgreesOnModulesWhileRecording(_Coordinator):
    """Mixin for ``PartitionedParameterCoordinator``: DeepSpeed's hooks of the module-order protocol, which lives in
    one :class:`~safe_zero.fixes.gradless.order.ModuleOrder` (``self._safe_zero.module_order``).

    - A kept module (``ModuleOrder.keep_gathered``) is invisible to the trace, the fetch and the release: its
      parameters are gathered at the start of each forward where they are not (a collective every rank makes
      there).
    - While DeepSpeed records the trace, the ranks all-gather the id of each module with non-empty parameters
      before its gather (one 8-byte element per rank per module, in recording forwards only). Where they differ,
      the ranks go on in lockstep (``lockstep.module_to_gather``): each round they gather one announced module
      together and the ranks that announced it enter it, until every rank's forward is over; then they compare
      which modules each entered, keep those some skipped gathered from then on and record the order again
      (``"optional_modules": false``, or a divergence inside a backward: the same ``RankDivergenceError`` on
      every rank instead). Once the trace is complete, prefetching follows it and nothing is added.
    - A rank that then skips what the recorded step ran (a tower on a text-only batch, one tower run of two)
      shadows it (``shadow.Shadow``): it makes those modules' fetches and releases, forward and backward, without
      their compute, so its gathers stay the recorded step's, as every other rank's do. Recorded in recording steps
      only; nothing is tracked in a step that follows the order.
    - A rank that runs what the recorded step did not (a module more often) cannot ask the others with a collective
      they might not make. It posts the module it entered to the process group's store and waits up to
      ``"module_order_timeout"`` seconds for every rank to post at the same point: all did, with the same module,
      and training goes on (DeepSpeed records the order again); otherwise it raises ``RankDivergenceError`` naming
      the module, instead of hanging in its next gather.
    - The module clock (``ModuleOrder.clock``) counts the modules entered, for the ZeRO-3 optimizer's walk.

    The hooks that run per module entry (the fetch, the trace's) carry the path of a step that follows the recorded
    order inline and call the protocol only off it.
    """

    _safe_zero: State

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        state = state_of(self)
        stock = cast("Coordinator", super(AgreesOnModulesWhileRecording, self))
        state.module_order = ModuleOrder(state.session, stock, self, AgreesOnModulesWhileRecording)
        super().__init__(*args, **kwargs)
        # DeepSpeed calls these per module entry: with nothing kept gathered and no divergence the hooks have nothing
        # to do, and with the fix off neither has the fetch (the module clock then has no follower).
        idle = ("trace_prologue", "release_sub_module") + (() if state.module_order.on else ("fetch_sub_module",))
        for name in idle:
            pass_through(self, name, AgreesOnModulesWhileRecording)

    @overrides
    def reset_step(self) -> None:
        state = self._safe_zero
        order = state.module_order
        assert order is not None
        order.begin_step()
        _watch_reads(order.dicts, state if order.phase is TracePhase.RECORDING else None)

    @overrides
    def _invalidate_trace(self) -> None:
        order = self._safe_zero.module_order
        assert order is not None
        order.trace_left()

    @overrides
    def trace_prologue(self, sub_module: ZeROModule) -> None:
        order = self._safe_zero.module_order
        assert order is not None
        if id(sub_module) not in order.kept_modules:
            super().trace_prologue(sub_module)

    @overrides
    def record_module(self, sub_module: ZeROModule) -> None:
        order = self._safe_zero.module_order
        assert order is not None
        if id(sub_module) not in order.kept_modules:
            super().record_module(sub_module)
            order.recording.append(sub_module.ds_id)

    @overrides
    def fetch_sub_module(self, current_submodule: ZeROModule, forward: bool) -> None:
        # DeepSpeed calls trace_prologue, then this, at each module entry: one hook carries the entry.
        order = self._safe_zero.module_order
        assert order is not None
        if id(current_submodule) in order.kept_modules:
            return
        if order.phase is TracePhase.LEFT or order.phase is TracePhase.SHADOWING:  # off the recorded order
            order.catch_up(Event(FETCH, current_submodule.ds_id, forward))
        # ``order.clock.tick(task)``, inlined: it runs per module entry.
        clock = order.clock
        position, follower, task = clock.position, clock.follower, torch._C._current_graph_task_id()
        if follower is not None and task != -1 and (position >= follower.wake_at or task != follower.wake_task):
            follower.at_module(position, task)
        clock.position = position + 1
        phase = order.phase
        if phase is TracePhase.LEFT:  # trace_prologue just left the recorded order, and no shadow gets this rank back
            order.leave(current_submodule, position)
        elif phase in AGREED_ENTRIES:
            order.entered(current_submodule, forward)
        super().fetch_sub_module(current_submodule, forward)

    @overrides
    def release_sub_module(self, submodule: ZeROModule, forward: bool = False) -> None:
        order = self._safe_zero.module_order
        assert order is not None
        if id(submodule) not in order.kept_modules:
            order.release(submodule, forward)
