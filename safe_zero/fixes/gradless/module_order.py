"""ZeRO-3's module order: the module clock, one module order on every rank, optional modules kept gathered, MoE
blocks gathered whole (docs/rank_agreement.md)."""

from __future__ import annotations

import collections
import datetime
import enum
import itertools
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as torch_dist
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero import parameter_offload
from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
from deepspeed.runtime.zero.partition_parameters import (ZeroParamStatus, register_external_parameter,
                                                          unregister_external_parameter)
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
from deepspeed.utils import set_z3_leaf_module, z3_leaf_module
from torch import nn

from safe_zero.errors import RankDivergenceError
from safe_zero.fixes.gradless import FIX
from safe_zero.fixes.gradless.lockstep import END, module_of, module_to_gather, read_of, skipped_modules
from safe_zero.fixes.gradless.planner import Planner
from safe_zero.fixes.gradless.shadow import FETCH, RELEASE, Event, Shadow
from safe_zero.leaf_modules import experts_beside_root, moe_blocks, optional_modules
from safe_zero.options import zero_stage
from safe_zero.patching import calls, overrides, pass_through, resume
from safe_zero.rank_progress import default_store
from safe_zero.session import Session, State, session_for, state_of


class ModuleClock:
    """The modules a ZeRO-3 forward and its backward have entered so far, as DeepSpeed's trace counts them: the
    same on every rank while they follow one module order.

    The one channel between safe_zero's coordinator, which moves it (:meth:`enter`, :meth:`restart`,
    :meth:`left_order`), and the optimizer whose walk follows it (:meth:`follow`). Every gather of a backward
    follows a module's entry, so a follower told of each entry before its gathers can hand over there what rank 0
    handed over before that point.
    """

    def __init__(self, recorded: Callable[[], bool]) -> None:
        self.position = 0
        #: Whether DeepSpeed's module order is recorded and still followed (a walk on this clock can hold).
        self.recorded = recorded
        #: The planner following this clock, and what to call at a module entry where it may hand over (:meth:`follow`).
        self.planner: Planner | None = None
        self.at_boundary: Callable[[int, int], None] = lambda position, task: None

    def follow(self, planner: Planner, at_boundary: Callable[[int, int], None]) -> None:
        """``at_boundary(position, task)`` is called at each module entry of a backward where ``planner`` may hand
        over something (its ``wake_at``/``wake_task``), before that module's gathers."""
        self.planner, self.at_boundary = planner, at_boundary

    def restart(self) -> None:
        """A forward begins (DeepSpeed's ``reset_step``), on every rank alike."""
        self.position = 0

    def enter(self, task: int) -> int:
        """A module is entered in autograd task ``task`` (-1: no backward runs), its gathers to follow. Called on
        every rank in the same order while they follow one module order. Returns the module's position."""
        position = self.position
        planner = self.planner
        if planner is not None and task != -1 and (position >= planner.wake_at or task != planner.wake_task):
            self.at_boundary(position, task)
        self.position = position + 1
        return position

    def left_order(self) -> None:
        """Every rank left the recorded module order at the same module (agreed through the store)."""
        if self.planner is not None:
            self.planner.left_order()


def _module_params(module: nn.Module) -> list[nn.Parameter]:
    return list(iter_params(module, recurse=z3_leaf_module(module)))


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
class KeepsOptionalModulesGathered:
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
    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        session = session_for(self)
        if not session.uses(FIX):
            return
        coordinator = self.get_param_coordinator()
        if not isinstance(coordinator, AgreesOnModulesWhileRecording):
            return
        coordinator.know_model(module, self.persistent_parameters, session.options.find_optional_modules)
        listed = optional_modules(module, session.options.optional_modules)
        experts = {name: m for name, m in experts_beside_root(module).items() if not _inside_any(name, listed)}
        if listed:
            coordinator.keep_gathered(listed, "listed in optional_modules")
        if experts:
            coordinator.keep_gathered(experts, "experts beside the model's root, which each rank routes differently")


def _inside_any(name: str, outer: dict[str, nn.Module]) -> bool:
    return any(name == o or name.startswith(f"{o}.") for o in outer)


def _size(params: list[nn.Parameter]) -> str:
    """What keeping ``params`` gathered costs on every rank (their whole size, not a partition)."""
    size = float(sum(p.ds_numel * p.element_size() for p in params))
    for unit in ("bytes", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.4g} {unit}"
        size /= 1024
    return f"{size:.4g} GiB"


def _skippable_candidates(names: list[str]) -> list[str]:
    """The children of the modules' deepest common ancestor on their paths: one of them is what some ranks skip."""
    distinct = list(dict.fromkeys(names))
    common = distinct[0].split(".")
    for name in distinct[1:]:
        parts = name.split(".")
        common = common[:next((k for k, (a, b) in enumerate(zip(common, parts)) if a != b),
                              min(len(common), len(parts)))]
    return list(dict.fromkeys(".".join(name.split(".")[:len(common) + 1]) for name in distinct))


def _left_alone_message(names: dict[int, str], module: nn.Module, expected: int | None, timeout: float) -> str:
    name = names.get(module.ds_id, type(module).__name__)
    other = names.get(expected, f"module #{expected}") if expected is not None else None
    ran = f"`{other}`, which" if other else "the module that"
    candidates = _skippable_candidates([name] + ([other] if other else []))
    # What a rank skips it shadows (shadow.py): what reaches here is a module this rank runs more often than the
    # recorded step did (an image and a video through one tower), or one that step never ran.
    return (f"under ZeRO-3 this rank entered `{name}` where DeepSpeed's recorded module order has {ran} the other "
            f"ranks are running now, and the recorded step runs `{name}` no further time that this rank could "
            f"follow: no other rank left the order within {timeout:g} s, so their parameter gathers no longer match "
            "this rank's (stock DeepSpeed hangs here). If the model runs a module more often for some inputs (one "
            "tower for images and videos), list it in the DeepSpeed config: "
            f'"safe_zero": {{"optional_modules": ["{candidates[0]}"]}} (one of {candidates}); its parameters '
            'then stay gathered on every rank. ("safe_zero": {"module_order_timeout": seconds} sets the wait.) If '
            "instead this rank ran out of batches while the others still train (uneven inputs), run the loop inside "
            "torch's Join([engine]) (docs/uneven_inputs.md).")


def _divergence_message(names_by_id: dict[int, str], ids: list[int]) -> str:
    names = [names_by_id.get(i, f"module #{i}") for i in ids]
    ran = ", ".join(f"rank {rank} `{name}`" for rank, name in enumerate(names))
    candidates = _skippable_candidates(names)
    return (f"under ZeRO-3 the ranks entered different modules at the same point of the forward ({ran}), so "
            "their parameter gathers would no longer match (stock DeepSpeed hangs here, or stops a step later "
            "with 'Detected a disagreement on list contents'). If the model skips a module for some inputs (an "
            "optional tower, a conditional adapter), list it in the DeepSpeed config, e.g. "
            f'"safe_zero": {{"optional_modules": ["{candidates[0]}"]}} (one of {candidates}): its parameters '
            "then stay gathered on every rank and it trains as DDP would. If these are experts of one MoE "
            'block, gather the block whole instead: "safe_zero": {"leaf_modules": {"add": ["<block class>"]}}.')


#: The flags of a module in the end-of-forward exchange (:meth:`AgreesOnModulesWhileRecording._entered_by_rank`).
ENTERED, READ = 1, 2
#: The rest of the byte: how often the module was entered (a tower run once per image and once per video), up to
#: ``MAX_RUNS``.
RUNS_SHIFT, MAX_RUNS = 2, 63
#: Held in a kept parameter's ``ds_active_sub_modules`` while a module that shares it is released: DeepSpeed releases
#: only parameters no module is using.
_KEPT = -1
#: Coordinators built in this process: the same number on every rank, so it names an engine in the store.
_BUILT = itertools.count()


class Phase(enum.Enum):
    """Where the module-order protocol stands in the running forward (:attr:`ModuleOrder.phase`)."""

    #: The fix is off: the coordinator is DeepSpeed's.
    OFF = "off"
    #: No order to record or follow until the next forward (the trace was left or invalidated in this one).
    UNRECORDED = "unrecorded"
    #: DeepSpeed records this forward's trace: the ranks agree on each module entry and read before its gather.
    RECORDING = "recording"
    #: Recording, and the ranks' modules differed: they go on in lockstep until the root's release settles it.
    LOCKSTEP = "lockstep"
    #: The trace is complete and this forward has followed it so far: nothing to agree on.
    FOLLOWING = "following"
    #: This step just left the recorded order at a module entry: it shadows what this rank skipped up to that module
    #: (``SHADOWING``), or the ranks agree on it through the store.
    LEFT = "left"
    #: This step left the recorded order on this rank alone and follows it still: it makes the fetches and releases of
    #: the recorded modules this rank skips, without their compute (``shadow.Shadow``).
    SHADOWING = "shadowing"


#: The phases in which module entries and reads are agreed on.
AGREEING = (Phase.RECORDING, Phase.LOCKSTEP)


class Ranks(Protocol):
    """What the protocol needs from the ranks: :class:`ProcessGroupRanks` on DeepSpeed's groups; the replays'
    (``tests/fixes/test_module_order_replay.py``) meet the other ranks' threads in one process."""

    def world_size(self, group: Any) -> int:
        """The ranks in ``group``."""

    def all_gather(self, group: Any, row: list[int], bits: int = 64) -> list[list[int]]:
        """Every rank's ``row`` (the same length everywhere, each value fitting in ``bits``), in rank order."""

    def meet(self, key: str, value: int, timeout: float) -> list[int] | None:
        """Every rank's ``value`` posted under ``key``, in rank order, without a collective (the process group's
        store); ``None`` if some rank did not post within ``timeout`` seconds."""


class ProcessGroupRanks:
    """:class:`Ranks` on DeepSpeed's process groups and the default store."""

    @staticmethod
    def world_size(group: Any) -> int:
        return dist.get_world_size(group=group)

    @staticmethod
    def all_gather(group: Any, row: list[int], bits: int = 64) -> list[list[int]]:
        dtype = torch.uint8 if bits == 8 else torch.int64
        mine = torch.tensor(row, dtype=dtype, device=get_accelerator().current_device_name())
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(everyone, mine, group=group)
        return [t.tolist() for t in everyone]

    @staticmethod
    def meet(key: str, value: int, timeout: float) -> list[int] | None:
        store = default_store()
        if store is None or torch_dist.get_world_size() < 2:
            return [value]
        rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
        store.set(f"{key}/{rank}", str(value))
        try:
            store.wait([f"{key}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout))
        except RuntimeError:  # the store's timeout (DistStoreError is a RuntimeError)
            return None
        return [int(store.get(f"{key}/{r}")) for r in range(world)]


class ModuleOrder:
    """The module-order protocol's state on one ZeRO-3 coordinator (``coordinator._safe_zero.module_order``)."""

    def __init__(self, on: bool, ranks: Ranks) -> None:
        self.on = on
        self.ranks = ranks
        self.phase = Phase.UNRECORDED if on else Phase.OFF
        #: Names the engine in the store (the same count on every rank), and the forwards begun (``reset_step``).
        self.engine_id = next(_BUILT)
        self.forwards = 0
        # The model, from know_model: names by ds_id (errors), (name, module) by ds_id, named_modules position by
        # ds_id (the lockstep's order), the root's ds_id, the ModuleList/ModuleDict names (experts).
        self.names: dict[int, str] = {}
        self.modules: dict[int, tuple[str, nn.Module]] = {}
        self.order: dict[int, int] = {}
        self.root_id: int | None = None
        self.alternatives: set[str] = set()
        #: DeepSpeed's list of persistent parameters, which kept ones join.
        self.persistent: list[nn.Parameter] = []
        #: Whether modules some ranks skip are found (``"optional_modules"`` not ``false``).
        self.find_skipped = False
        #: The model's parameter dictionaries (``ZeROOrderedDict``), which watch reads in recording forwards.
        self.dicts: list[Any] = []
        #: Kept gathered: ``id()`` of each module in a kept one, and the kept parameters (an ordered set).
        self.kept_modules: frozenset[int] | set[int] = frozenset()
        self.kept: dict[nn.Parameter, None] = {}
        #: The module ids of the trace being recorded, and of the last one recorded.
        self.recording: list[int] = []
        self.recorded: list[int] = []
        #: Modules whose parameters this recording forward read from outside them.
        self.read: set[int] = set()
        #: The data-parallel group of the last module agreed on.
        self.group: Any = None
        #: In a lockstep: the modules this rank entered (or read) gathered whole, and the ``ds_id`` of every module
        #: inside them.
        self.wholes: list[nn.Module] = []
        self.inside: frozenset[int] | set[int] = frozenset()
        #: Reads the lockstep served this forward: (module running, module read, parameter).
        self.served_reads: list[tuple[nn.Module, nn.Module, nn.Parameter]] = []
        #: The events of the recorded step, which a rank that skips some of them makes without their compute.
        self.shadow = Shadow()
        #: Whether this step's backward makes what is left of the recorded step at its end (an autograd callback).
        self.rest_queued = False


class AgreesBeforeReadingAParameter:
    """Mixin for DeepSpeed's ``ZeROOrderedDict`` (a module's ``_parameters`` under ZeRO-3): a parameter read in a
    forward while it is not gathered, outside its module's entry (Qwen2-VL's ``self.proj.weight.dtype`` before calling
    ``self.proj``), is one DeepSpeed gathers on the reading rank alone. While the ranks record the module order the
    coordinator agrees on it first (:meth:`AgreesOnModulesWhileRecording.agree_on_read`). The model's dictionaries
    take this class for recording forwards only (:func:`_watch_reads`): every other read costs nothing.
    ``_safe_zero``: the coordinator that agrees."""

    _safe_zero: AgreesOnModulesWhileRecording

    @overrides
    def __getitem__(self, key: str) -> Any:
        param = dict.__getitem__(self, key)  # type: ignore[arg-type]
        coordinator = self._safe_zero
        status = getattr(param, "ds_status", None)
        if self._in_forward and (status == ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]
                                 or (coordinator._safe_zero.module_order.inside
                                     and status == ZeroParamStatus.AVAILABLE)):
            coordinator.agree_on_read(self._parent_module, param)  # type: ignore[attr-defined]
        return super().__getitem__(key)  # type: ignore[misc]


class SafeZeROOrderedDict(AgreesBeforeReadingAParameter, ZeROOrderedDict):
    """``ZeROOrderedDict`` that agrees before a read gathers, for recording forwards."""


def _watch_reads(dicts: list[Any], coordinator: AgreesOnModulesWhileRecording | None) -> None:
    """Give the model's parameter dictionaries the class that agrees on reads (a coordinator), or DeepSpeed's back
    (``None``): the same instances, so DeepSpeed's own state on them stays."""
    klass = ZeROOrderedDict if coordinator is None else SafeZeROOrderedDict
    if dicts and type(dicts[0]) is not klass:
        for params in dicts:
            params.__class__ = klass
            params._safe_zero = coordinator


@calls("is_record_trace", "is_complete_trace", "is_invalid_trace")
class AgreesOnModulesWhileRecording:
    """Mixin for ``PartitionedParameterCoordinator``: kept modules out of the trace, and one module order.

    - A kept module (:meth:`keep_gathered`) is invisible to the trace, the fetch and the release: its
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
    - ``module_clock`` (:class:`ModuleClock`) counts the modules entered, for the ZeRO-3 optimizer's walk.

    Its state is one :class:`ModuleOrder` (``self._safe_zero.module_order``), whose :class:`Phase` says where the
    running forward stands; every collective and store wait of the protocol goes through its :class:`Ranks` (the
    replays in ``tests/fixes/test_module_order_replay.py`` set theirs on a coordinator built over a stand-in for
    DeepSpeed's).
    """

    _safe_zero: State

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        state = state_of(self)
        on = state.session.uses(FIX)
        state.module_order = ModuleOrder(on, ProcessGroupRanks())
        super().__init__(*args, **kwargs)
        self.module_clock = ModuleClock(lambda: not self.is_invalid_trace())
        # DeepSpeed calls these per module entry: with nothing kept gathered and no divergence the overrides have
        # nothing to do, and with the fix off neither has the fetch (the module clock then has no follower).
        idle = ("trace_prologue", "release_sub_module") + (() if on else ("fetch_sub_module",))
        for name in idle:
            pass_through(self, name, AgreesOnModulesWhileRecording)

    def know_model(self, root: nn.Module, persistent: list[nn.Parameter], find_skipped: bool) -> None:
        """The model's modules (names for errors, ``named_modules`` order for the lockstep), DeepSpeed's list of
        persistent parameters that kept ones join, and whether to find modules some ranks skip."""
        order = self._safe_zero.module_order
        named = [(name, m) for name, m in root.named_modules() if hasattr(m, "ds_id")]
        order.names = {m.ds_id: name or type(root).__name__ for name, m in named}
        order.modules = {m.ds_id: (name, m) for name, m in named}
        order.order = {m.ds_id: index for index, (_, m) in enumerate(named)}
        order.root_id = root.ds_id
        order.alternatives = {name for name, m in named if isinstance(m, (nn.ModuleList, nn.ModuleDict))}
        order.persistent = persistent
        order.find_skipped = find_skipped
        order.dicts = [m._parameters for _, m in named if type(m._parameters) is ZeROOrderedDict]

    def keep_gathered(self, modules: dict[str, nn.Module], why: str, gather_now: bool = False) -> None:
        """Leave ``modules`` (by name) out of the trace, fetch and release, and keep their parameters gathered:
        from the next forward on, or at once (``gather_now``, on every rank alike)."""
        order = self._safe_zero.module_order
        params = list(dict.fromkeys(p for outer in modules.values() for p in outer.parameters()))
        for param in params:
            if not param.ds_persist:
                param.ds_persist = True
                order.persistent.append(param)
        order.kept_modules = {*order.kept_modules, *(id(m) for outer in modules.values() for m in outer.modules())}
        order.kept.update(dict.fromkeys(params))
        for name in ("trace_prologue", "release_sub_module"):
            resume(self, name, AgreesOnModulesWhileRecording)
        if gather_now:
            self._gather_alike(params, entering=True, name=", ".join(modules))
        session_for(self).engaged(FIX, f"optional module(s) {', '.join(modules)} kept gathered on every rank under "
                                       f"ZeRO-3 ({why}; {_size(params)} per rank)")

    @overrides
    def reset_step(self) -> None:
        order = self._safe_zero.module_order
        if order.phase is Phase.LEFT and not self.is_invalid_trace():
            super()._invalidate_trace()  # deferred (_invalidate_trace), and no fetch came to shadow or leave
        recorded = self.is_record_trace() and bool(order.recording)
        if recorded:
            order.recorded = order.recording
        super().reset_step()
        order.recording = []
        order.forwards += 1
        order.rest_queued = False
        # A step that followed the recorded order tracked nothing: no call for it (per step, every step).
        shadow, followed = order.shadow, order.phase is Phase.FOLLOWING
        if recorded:
            shadow.commit()
        elif not self.is_complete_trace():
            shadow.discard()
        elif not followed:
            shadow.restart()
        if order.on:
            order.phase = (Phase.RECORDING if self.is_record_trace() else
                           Phase.FOLLOWING if self.is_complete_trace() else Phase.UNRECORDED)
            # A recording step records its releases for the shadow; a following one needs the override only for kept
            # modules (or once it shadows).
            watch = order.phase is Phase.RECORDING or bool(order.kept)
            idle = self.__dict__.get("_safe_zero_idle", {}).get("release_sub_module", ())
            if watch == (AgreesOnModulesWhileRecording in idle):
                (resume if watch else pass_through)(self, "release_sub_module", AgreesOnModulesWhileRecording)
        order.read = set()
        _watch_reads(order.dicts, self if order.phase is Phase.RECORDING else None)
        self.module_clock.restart()
        released = [p for p in order.kept if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if released:  # released on every rank alike: by an optimizer step, a checkpoint or empty_partition_cache
            released[0].all_gather(param_list=released)

    @overrides
    def _invalidate_trace(self) -> None:
        # trace_prologue found the module entered off the recorded order (or hooks were registered again)
        order = self._safe_zero.module_order
        if (order.phase is Phase.FOLLOWING or order.phase is Phase.SHADOWING) and order.shadow.recorded \
                and order.find_skipped:
            # Deferred: the fetch that follows shadows what this rank skipped up to that module, if the recorded step
            # has it further on, else invalidates then (reset_step, if no fetch follows).
            order.phase = Phase.LEFT
            return
        super()._invalidate_trace()
        if order.phase is Phase.FOLLOWING:
            order.phase = Phase.LEFT
        elif order.phase is not Phase.OFF and order.phase is not Phase.LOCKSTEP:  # the root's release settles that
            order.phase = Phase.UNRECORDED

    @overrides
    def trace_prologue(self, sub_module: nn.Module) -> None:
        if id(sub_module) not in self._safe_zero.module_order.kept_modules:
            super().trace_prologue(sub_module)

    def _agree_on_leaving_the_trace(self, module: nn.Module, position: int) -> None:
        order = self._safe_zero.module_order
        timeout = session_for(self).options.module_order_timeout
        ids = order.ranks.meet(f"safe_zero/module_order/{order.engine_id}/{order.forwards}/{position}", module.ds_id,
                               timeout)
        if ids is None:
            expected = order.recorded[position] if position < len(order.recorded) else None
            raise RankDivergenceError(_left_alone_message(order.names, module, expected, timeout))
        if len(set(ids)) > 1:
            raise RankDivergenceError(_divergence_message(order.names, ids))

    @overrides
    def record_module(self, sub_module: nn.Module) -> None:
        order = self._safe_zero.module_order
        if id(sub_module) not in order.kept_modules:
            super().record_module(sub_module)
            order.recording.append(sub_module.ds_id)

    @overrides
    def fetch_sub_module(self, current_submodule: nn.Module, forward: bool) -> None:
        # DeepSpeed calls trace_prologue, then this, at each module entry: one override carries the entry.
        order = self._safe_zero.module_order
        if id(current_submodule) in order.kept_modules:
            return
        phase = order.phase
        if phase is Phase.LEFT or phase is Phase.SHADOWING:  # off the recorded order in this step
            phase = self._shadow_up_to(Event(FETCH, current_submodule.ds_id, forward))
        # ``self.module_clock.enter(task)``, inlined: it runs per module entry.
        clock = self.module_clock
        position, planner, task = clock.position, clock.planner, torch._C._current_graph_task_id()
        if planner is not None and task != -1 and (position >= planner.wake_at or task != planner.wake_task):
            clock.at_boundary(position, task)
        clock.position = position + 1
        if phase is Phase.LEFT:  # trace_prologue just left the recorded order, and no shadow gets this rank back
            order.phase = Phase.UNRECORDED
            self._agree_on_leaving_the_trace(current_submodule, position)
            clock.left_order()
        elif phase in AGREEING:
            order.shadow.record(Event(FETCH, current_submodule.ds_id, forward))
            # Modules whose parameters are all zero-element gather nothing: no agreement either.
            params = [p for p in _module_params(current_submodule) if p.ds_numel > 0] if forward else None
            if params:
                order.group = params[0].ds_process_group
                self._agree_on_module(current_submodule.ds_id, params)
        super().fetch_sub_module(current_submodule, forward)

    def _shadow_up_to(self, event: Event) -> Phase:
        """This rank's own ``event`` in a step that left the recorded order here (``LEFT``) or before (``SHADOWING``):
        first make the recorded events this rank skipped before it, as every rank that runs them makes them. Returns
        the phase ``event`` goes on in: ``LEFT`` where the recorded step has no such event ahead (this rank runs a
        module more often than that step did), and the trace is invalidated then."""
        order = self._safe_zero.module_order
        shadow = order.shadow
        if not shadow.shadowing:
            shadow.start(self.module_clock.position, self._still_held)
            resume(self, "release_sub_module", AgreesOnModulesWhileRecording)
        missed = shadow.catch_up(event)
        if missed is None:
            if event.kind == RELEASE:  # a release changes nothing another rank sees: DeepSpeed's own, as it comes
                return order.phase
            shadow.discard()
            super()._invalidate_trace()
            order.phase = Phase.LEFT
            return Phase.LEFT
        if not order.rest_queued and torch._C._current_graph_task_id() != -1:
            # What the recorded backward makes after this rank's last event: at the end of this backward, inside it
            # (its module entries wake the optimizer's walk, which asks autograd what this backward reaches).
            order.rest_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._shadow_the_rest)
        self._make(missed)
        return Phase.SHADOWING

    def _make(self, events: list[Event]) -> None:
        """Make ``events`` as DeepSpeed's hooks would, without the compute: through the whole coordinator, on the
        plain path of a step that follows the recorded order."""
        order = self._safe_zero.module_order
        order.phase = Phase.FOLLOWING
        try:
            for kind, module_id, forward in events:
                module = order.modules[module_id][1]
                if kind == FETCH:
                    self.fetch_sub_module(module, forward)
                else:
                    self.release_sub_module(module, forward)
        finally:
            order.phase = Phase.SHADOWING

    def _shadow_the_rest(self) -> None:
        order = self._safe_zero.module_order
        if order.phase is Phase.SHADOWING:
            self._make(order.shadow.rest())

    def _still_held(self, event: Event) -> bool:
        """Whether ``event``'s module (a release) still holds its parameters as fetched on this rank."""
        module = self._safe_zero.module_order.modules[event.module][1]
        return any(event.module in p.ds_active_sub_modules for p in _module_params(module))

    def agree_on_read(self, owner: nn.Module, param: nn.Parameter) -> None:
        """A recording forward reads ``param`` of ``owner`` outside ``owner``'s entry. Not gathered: DeepSpeed is about
        to gather it on this rank alone, so the ranks agree on it first, as on an entry. Gathered only because the
        lockstep gathered ``owner`` whole for this rank: registered with the module running, as DeepSpeed's access
        registers what it gathers where the ranks agree."""
        order = self._safe_zero.module_order
        if order.phase not in AGREEING or param.ds_numel == 0 or not hasattr(owner, "ds_id"):
            return
        stack = parameter_offload.FWD_MODULE_STACK
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            # Before ``owner`` ran (minicpmv4_6's text model, gathered whole while the image rank is in the tower,
            # reads ``conv1d.weight`` without entering ``conv1d``); else DeepSpeed's access would not gather it either.
            if owner.ds_id not in order.inside or param.ds_persist or owner in stack:
                return
        else:
            order.group = param.ds_process_group
            self._agree_on_module(read_of(owner.ds_id), [param])
        order.read.add(owner.ds_id)
        if param.ds_status == ZeroParamStatus.AVAILABLE and stack:
            # Gathered by the lockstep, so DeepSpeed's access will not register it with the module running, as it does
            # with what it gathers itself (that module's backward gathers it again): registered here instead, and
            # taken back at the end of the forward where not every rank read it (its module is kept gathered then).
            # Once per reader: a forward may read it again (Mllama's ``patch_embedding.weight.dtype``, then
            # ``.device``), and a registration is a dictionary entry, taken back once.
            reader = stack[-1]
            if id(param) not in getattr(reader, "_external_params", {}):
                register_external_parameter(reader, param)
                order.served_reads.append((reader, owner, param))

    @overrides
    def release_sub_module(self, submodule: nn.Module, forward: bool = False) -> None:
        order = self._safe_zero.module_order
        if id(submodule) in order.kept_modules:
            return
        if order.phase is Phase.SHADOWING:
            self._shadow_up_to(Event(RELEASE, submodule.ds_id, forward))
        elif order.phase in AGREEING and _module_params(submodule):  # a release without parameters changes nothing
            order.shadow.record(Event(RELEASE, submodule.ds_id, forward))
        # While DeepSpeed records it releases persistent parameters too: a kept one that this module shares (a weight
        # tied to a module some ranks skip) stays gathered, or the kept module would read it released on its ranks.
        kept = order.kept
        shared = [p for p in _module_params(submodule) if p.ds_persist and p in kept] if kept else []
        for param in shared:
            param.ds_active_sub_modules.add(_KEPT)
        try:
            super().release_sub_module(submodule, forward)
        finally:
            for param in shared:
                param.ds_active_sub_modules.discard(_KEPT)
        if forward and submodule in order.wholes:
            self._leave_whole([submodule])
        if forward and order.phase is Phase.LOCKSTEP and submodule.ds_id == order.root_id:
            self._settle_divergence()

    def _all_ints(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order (a collective)."""
        order = self._safe_zero.module_order
        return [row[0] for row in order.ranks.all_gather(order.group, [value])]

    def _agree_on_module(self, announcement: int, params: Sequence[nn.Parameter] = ()) -> None:
        """Before this rank gathers ``params`` of the module announced (an entry, or ``read_of`` one; ``END``: after
        its forward), in a recording forward."""
        order = self._safe_zero.module_order
        module_id = module_of(announcement)
        if order.ranks.world_size(order.group) < 2:
            return
        if module_id in order.inside and all(p.ds_status != ZeroParamStatus.NOT_AVAILABLE for p in params):
            return  # gathered whole for this rank already
        while (chosen := module_to_gather(announced := self._all_ints(announcement), order.order)) is not None:
            # A backward's gathers follow autograd, not this rule: a divergence there (a recomputed forward) stops.
            if not order.find_skipped or torch._C._current_graph_task_id() != -1:
                raise RankDivergenceError(_divergence_message(order.names, list(map(module_of, announced))))
            order.phase = Phase.LOCKSTEP
            resume(self, "release_sub_module", AgreesOnModulesWhileRecording)  # the root's release settles it
            # The whole module, its children included: a forward may read a child's weight before calling it, and
            # the ranks entering it gather nothing more inside.
            name, module = order.modules[chosen]
            self._gather_alike([p for p in module.parameters() if p.ds_numel > 0], chosen == module_id, name)
            if chosen == module_id:
                order.wholes.append(module)
                order.inside = {*order.inside, *(m.ds_id for m in module.modules() if hasattr(m, "ds_id"))}
                return

    def _leave_whole(self, modules: list[nn.Module]) -> None:
        """Out of ``modules`` gathered whole for this rank: what their children's releases left gathered goes too,
        so every rank holds the same again."""
        order = self._safe_zero.module_order
        order.wholes = [m for m in order.wholes if m not in modules]
        order.inside = {m.ds_id for whole in order.wholes for m in whole.modules() if hasattr(m, "ds_id")}
        idle = [p for module in modules for p in module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE
                and not p.ds_active_sub_modules and not p.ds_persist]
        if idle:
            idle[0].partition(param_list=idle)

    def _gather_alike(self, params: list[nn.Parameter], entering: bool, name: str) -> None:
        """Gather what of ``params`` (of module ``name``) is partitioned, on every rank together; a rank not
        ``entering`` their module partitions them again at once, so outside the modules a rank is running every rank
        holds the same."""
        # Held by some ranks only (a persistent parameter released where its module ran while DeepSpeed records):
        # partitioned first, so every rank gathers the same list.
        idle = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_active_sub_modules]
        if idle:
            idle[0].partition(param_list=idle)
        # A persistent one this rank held stays held: its forward may have read it from outside its module,
        # unregistered (DeepSpeed registers what it gathers), so no fetch would gather it again for the backward.
        held = {p for p in idle if p.ds_persist}
        params = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        counts = self._all_ints(len(params))
        if len(set(counts)) > 1:  # a parameter shared with a module some rank is running: not gathered alike
            raise RankDivergenceError(
                f"under ZeRO-3 the ranks hold different parts of `{name}` gathered ({counts} parameters per rank) "
                "where their forwards diverged: a parameter it shares with a module some rank is running. List the "
                f'modules some ranks skip from the start: "safe_zero": {{"optional_modules": ["{name}"]}} (or the '
                "module around it that some ranks skip); their parameters then stay gathered on every rank.")
        if params:
            params[0].all_gather(param_list=params)
            released = [p for p in params if p not in held] if not entering else []
            if released:
                released[0].partition(param_list=released)

    def _settle_divergence(self) -> None:
        """This rank's forward is over after a divergence: serve the others' gathers until every forward is over,
        then keep what some ranks skipped gathered and record the order again (on every rank alike)."""
        order = self._safe_zero.module_order
        self._agree_on_module(END)
        order.phase = Phase.UNRECORDED
        self._leave_whole(order.wholes)  # modules only read, never entered
        if not order.kept:
            pass_through(self, "release_sub_module", AgreesOnModulesWhileRecording)
        entered, read, runs = self._entered_by_rank()
        skipped = skipped_modules(entered, order.alternatives, read, runs)
        # A read some ranks made only keeps its module gathered (``skipped``): the reading module's fetch list is the
        # same on every rank again.
        everyone = set.intersection(*read)
        for reader, owner, param in order.served_reads:
            if order.modules[owner.ds_id][0] not in everyone:
                unregister_external_parameter(reader, param)
        order.served_reads = []
        by_name = {name: m for name, m in order.modules.values()}
        modules = {name: by_name[name] for name in skipped}
        if modules:
            self.keep_gathered(modules, "found: some ranks skipped them in a forward", gather_now=True)
        if not self.is_invalid_trace():
            self._invalidate_trace()  # this forward's order differs between the ranks: record it again

    def _entered_by_rank(self) -> tuple[list[set[str]], list[set[str]], list[dict[str, int]]]:
        """Per rank, the names of the modules this recording forward entered, of those whose parameters it read
        from outside, and how often it entered each (a collective of one byte per module)."""
        order = self._safe_zero.module_order
        mine = [0] * len(order.order)
        for i, runs in collections.Counter(order.recording).items():
            mine[order.order[i]] = ENTERED | min(runs, MAX_RUNS) << RUNS_SHIFT
        for i in order.read:
            mine[order.order[i]] |= READ
        names = [name for name, _ in order.modules.values()]
        everyone = order.ranks.all_gather(order.group, mine, bits=8)
        return ([{names[i] for i, flags in enumerate(row) if flags & ENTERED} for row in everyone],
                [{names[i] for i, flags in enumerate(row) if flags & READ} for row in everyone],
                [{names[i]: flags >> RUNS_SHIFT for i, flags in enumerate(row) if flags & ENTERED} for row in everyone])
