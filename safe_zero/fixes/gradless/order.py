"""ZeRO-3's module-order protocol on one coordinator: :class:`ModuleOrder` (docs/rank_agreement.md).

One object owns the protocol's state and makes its decisions; ``module_order.AgreesOnModulesWhileRecording`` is the
DeepSpeed coordinator's hooks over it, as ``adapter.PlannerAdapter`` is the optimizer's over its planner. Its pure
parts are replayed on their own: ``lockstep`` (which module the ranks gather next where their entries differ, and what
some skipped) and ``shadow`` (where a rank that left the recorded order stands in it). Every collective and store wait
goes through the session's ``Ranks`` (``safe_zero.ranks``), so ``tests/fixes/test_module_order_replay.py`` runs this
code with one thread per rank.

The clock (:class:`ModuleClock`) counts the modules a forward and its backward entered, the same on every rank while
they follow one order. The coordinator's ``ModuleOrder`` owns it and alone moves it; the ZeRO-3 optimizer's planner
follows it: it is told of each backward module entry from its ``wake_at`` on (:class:`Follower`) and of the ranks
leaving the order, and reads the clock's ``position`` and ``followed``. It calls nothing back.
"""

from __future__ import annotations

import collections
import enum
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch
from deepspeed.runtime.zero import parameter_offload
from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
from deepspeed.runtime.zero.partition_parameters import (ZeroParamStatus, register_external_parameter,
                                                          unregister_external_parameter)
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
from deepspeed.utils import z3_leaf_module
from torch import nn

from safe_zero.errors import RankDivergenceError
from safe_zero.fixes.gradless import FIX
from safe_zero.fixes.gradless.lockstep import END, module_of, module_to_gather, read_of, skipped_modules
from safe_zero.fixes.gradless.shadow import FETCH, RELEASE, Event, Shadow
from safe_zero.patching import pass_through, resume
from safe_zero.session import Session

if TYPE_CHECKING:
    from safe_zero.zero_types import ZeROModule, ZeROParameter


class TracePhase(enum.Enum):
    """Where the running forward stands against DeepSpeed's trace of the module order (:attr:`ModuleOrder.phase`)."""

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
AGREED_ENTRIES = frozenset({TracePhase.RECORDING, TracePhase.LOCKSTEP})
#: The flags of a module in the end-of-forward exchange (:meth:`ModuleOrder._entered_by_rank`).
ENTERED, READ = 1, 2
#: The rest of the byte: how often the module was entered (a tower run once per image and once per video), up to
#: ``MAX_RUNS``.
RUNS_SHIFT, MAX_RUNS = 2, 63
#: Held in a kept parameter's ``ds_active_sub_modules`` while a module that shares it is released: DeepSpeed releases
#: only parameters no module is using.
_KEPT = -1


class Follower(Protocol):
    """The ZeRO-3 optimizer's planner, following the clock (``adapter.Gradless``)."""

    #: Tell it of a backward's module entries from this position on, or in another autograd task than ``wake_task``
    #: (-1: outside one); before that nothing it holds can be due. The follower sets these; the clock only reads them.
    wake_at: int
    wake_task: int

    def at_module(self, position: int, task: int) -> None:
        """The backward (autograd task ``task``) enters a module at ``position``; its gathers follow."""

    def left_order(self) -> None:
        """Every rank left the recorded module order at the same module (agreed through the store)."""


class Coordinator(Protocol):
    """What the protocol calls of DeepSpeed's ``PartitionedParameterCoordinator``: the next class after safe_zero's
    hooks (``super(AgreesOnModulesWhileRecording, coordinator)``)."""

    def is_record_trace(self) -> bool: ...
    def is_complete_trace(self) -> bool: ...
    def is_invalid_trace(self) -> bool: ...
    def reset_step(self) -> None: ...
    def _invalidate_trace(self) -> None: ...
    def fetch_sub_module(self, current_submodule: ZeROModule, forward: bool) -> None: ...
    def release_sub_module(self, submodule: ZeROModule, forward: bool = False) -> None: ...


class ModuleClock:
    """The modules a ZeRO-3 forward and its backward have entered so far, as DeepSpeed's trace counts them: the same
    on every rank while they follow one module order. Every gather of a backward follows a module's entry, so a
    follower told of each entry before its gathers can hand over there what the other ranks hand over there."""

    def __init__(self) -> None:
        self.position = 0
        #: Whether DeepSpeed's module order is recorded and still followed (a walk on this clock can hold).
        self.followed = False
        #: The planner told of the backward's module entries.
        self.follower: Follower | None = None

    def follow(self, follower: Follower) -> None:
        """``follower`` is told of the backward's module entries (:class:`Follower`) from now on."""
        self.follower = follower

    def tick(self, task: int) -> int:
        """A module is entered in autograd task ``task`` (-1: no backward runs), its gathers to follow: tell the
        follower where it may hand over, and move on. Returns the module's position. (The coordinator's
        ``fetch_sub_module`` inlines this: it runs per module entry.)"""
        position, follower = self.position, self.follower
        if follower is not None and task != -1 and (position >= follower.wake_at or task != follower.wake_task):
            follower.at_module(position, task)
        self.position = position + 1
        return position


def module_params(module: ZeROModule) -> list[ZeROParameter]:
    """The parameters DeepSpeed fetches for ``module`` (a leaf module's, its children's too)."""
    return list(iter_params(module, recurse=z3_leaf_module(module)))


class ModuleOrder:
    """The module-order protocol on one ZeRO-3 coordinator (``coordinator._safe_zero.module_order``).

    ``stock``: DeepSpeed's coordinator below safe_zero's hooks; ``hooks``: the coordinator itself, whose idle hooks
    this object switches off and on (``patching.pass_through``) as the phase needs them; ``hooks_class``: the mixin
    that holds them. The only writer of :attr:`phase` is :meth:`_set_phase`.
    """

    def __init__(self, session: Session, stock: Coordinator, hooks: Any, hooks_class: type) -> None:
        self.session = session
        self.on = session.uses(FIX)
        self.ranks = session.ranks
        self.stock, self.hooks, self.hooks_class = stock, hooks, hooks_class
        self.phase = TracePhase.UNRECORDED if self.on else TracePhase.OFF
        self.clock = ModuleClock()
        #: The forwards begun (``begin_step``): with the position, names a meeting in the store.
        self.forwards = 0
        # The model, from know_model: names by ds_id (errors), (name, module) by ds_id, named_modules position by
        # ds_id (the lockstep's order), the root's ds_id, the ModuleList/ModuleDict names (experts).
        self.names: dict[int, str] = {}
        self.modules: dict[int, tuple[str, ZeROModule]] = {}
        self.order: dict[int, int] = {}
        self.root_id: int | None = None
        self.alternatives: set[str] = set()
        #: DeepSpeed's list of persistent parameters, which kept ones join.
        self.persistent: list[ZeROParameter] = []
        #: Whether modules some ranks skip are found (``"optional_modules"`` not ``false``).
        self.find_skipped = False
        #: The model's parameter dictionaries (``ZeROOrderedDict``), which watch reads in recording forwards.
        self.dicts: list[ZeROOrderedDict] = []
        #: Kept gathered: ``id()`` of each module in a kept one, and the kept parameters (an ordered set).
        self.kept_modules: frozenset[int] | set[int] = frozenset()
        self.kept: dict[ZeROParameter, None] = {}
        #: The module ids of the trace being recorded, and of the last one recorded.
        self.recording: list[int] = []
        self.recorded: list[int] = []
        #: Modules whose parameters this recording forward read from outside them.
        self.read: set[int] = set()
        #: The data-parallel group of the last module agreed on.
        self.group: Any = None
        #: In a lockstep: the modules this rank entered (or read) gathered whole, and the ``ds_id`` of every module
        #: inside them.
        self.wholes: list[ZeROModule] = []
        self.inside: frozenset[int] | set[int] = frozenset()
        #: Reads the lockstep served this forward: (module running, module read, parameter).
        self.served_reads: list[tuple[ZeROModule, ZeROModule, ZeROParameter]] = []
        #: The events of the recorded step, which a rank that skips some of them makes without their compute.
        self.shadow = Shadow()
        #: Whether this step's backward makes what is left of the recorded step at its end (an autograd callback).
        self.rest_queued = False

    def _set_phase(self, phase: TracePhase) -> None:
        self.phase = phase

    # -- the model -------------------------------------------------------------------------------------------------

    def know_model(self, root: ZeROModule, persistent: list[ZeROParameter], find_skipped: bool) -> None:
        """The model's modules (names for errors, ``named_modules`` order for the lockstep), DeepSpeed's list of
        persistent parameters that kept ones join, and whether to find modules some ranks skip."""
        named = [(name, m) for name, m in root.named_modules() if hasattr(m, "ds_id")]
        self.names = {m.ds_id: name or type(root).__name__ for name, m in named}
        self.modules = {m.ds_id: (name, m) for name, m in named}
        self.order = {m.ds_id: index for index, (_, m) in enumerate(named)}
        self.root_id = root.ds_id
        self.alternatives = {name for name, m in named if isinstance(m, (nn.ModuleList, nn.ModuleDict))}
        self.persistent = persistent
        self.find_skipped = find_skipped
        self.dicts = [m._parameters for _, m in named if type(m._parameters) is ZeROOrderedDict]

    def keep_gathered(self, modules: dict[str, ZeROModule], why: str, gather_now: bool = False) -> None:
        """Leave ``modules`` (by name) out of the trace, fetch and release, and keep their parameters gathered:
        from the next forward on, or at once (``gather_now``, on every rank alike)."""
        params = list(dict.fromkeys(p for outer in modules.values() for p in outer.parameters()))
        for param in params:
            if not param.ds_persist:
                param.ds_persist = True
                self.persistent.append(param)
        self.kept_modules = {*self.kept_modules, *(id(m) for outer in modules.values() for m in outer.modules())}
        self.kept.update(dict.fromkeys(params))
        for name in ("trace_prologue", "release_sub_module"):
            resume(self.hooks, name, self.hooks_class)
        if gather_now:
            self._gather_alike(params, entering=True, name=", ".join(modules))
        self.session.engaged(FIX, f"optional module(s) {', '.join(modules)} kept gathered on every rank under "
                                  f"ZeRO-3 ({why}; {_size(params)} per rank)")

    # -- a step ----------------------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """DeepSpeed's ``reset_step``: a forward begins. Settles what the last step recorded or left, and the phase
        this one begins in."""
        if self.phase is TracePhase.LEFT and not self.stock.is_invalid_trace():
            self._invalidate()  # deferred (trace_left), and no fetch came to shadow or leave
        recorded = self.stock.is_record_trace() and bool(self.recording)
        if recorded:
            self.recorded = self.recording
        self.stock.reset_step()
        self.recording = []
        self.forwards += 1
        self.rest_queued = False
        self.clock.followed = not self.stock.is_invalid_trace()
        # A step that followed the recorded order tracked nothing: no call for it (per step, every step).
        shadow, followed = self.shadow, self.phase is TracePhase.FOLLOWING
        if recorded:
            shadow.commit()
        elif not self.stock.is_complete_trace():
            shadow.discard()
        elif not followed:
            shadow.restart()
        if self.on:
            self._set_phase(TracePhase.RECORDING if self.stock.is_record_trace() else
                            TracePhase.FOLLOWING if self.stock.is_complete_trace() else TracePhase.UNRECORDED)
            # A recording step records its releases for the shadow; a following one needs the hook only for kept
            # modules (or once it shadows).
            self._watch_releases(self.phase is TracePhase.RECORDING or bool(self.kept))
        self.read = set()
        self.clock.position = 0
        released = [p for p in self.kept if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if released:  # released on every rank alike: by an optimizer step, a checkpoint or empty_partition_cache
            released[0].all_gather(param_list=released)

    def _watch_releases(self, watch: bool) -> None:
        idle = self.hooks.__dict__.get("_safe_zero_idle", {}).get("release_sub_module", ())
        if watch == (self.hooks_class in idle):
            (resume if watch else pass_through)(self.hooks, "release_sub_module", self.hooks_class)

    def _invalidate(self) -> None:
        self.stock._invalidate_trace()
        self.clock.followed = False

    def trace_left(self) -> None:
        """DeepSpeed invalidates its trace: ``trace_prologue`` found the module entered off the recorded order (or
        hooks were registered again)."""
        phase = self.phase
        if (phase is TracePhase.FOLLOWING or phase is TracePhase.SHADOWING) and self.shadow.recorded \
                and self.find_skipped:
            # Deferred: the fetch that follows shadows what this rank skipped up to that module, if the recorded step
            # has it further on, else invalidates then (begin_step, if no fetch follows).
            self._set_phase(TracePhase.LEFT)
            return
        self._invalidate()
        if phase is TracePhase.FOLLOWING:
            self._set_phase(TracePhase.LEFT)
        elif phase is not TracePhase.OFF and phase is not TracePhase.LOCKSTEP:  # the root's release settles that
            self._set_phase(TracePhase.UNRECORDED)

    # -- a module entry (DeepSpeed's fetch_sub_module) -------------------------------------------------------------

    def catch_up(self, event: Event) -> None:
        """This rank's own ``event`` in a step that left the recorded order here (``LEFT``) or before (``SHADOWING``):
        first make the recorded events this rank skipped before it, as every rank that runs them makes them. The
        phase stays ``LEFT`` where the recorded step has no such event ahead (this rank runs a module more often than
        that step did), and the trace is invalidated then."""
        shadow = self.shadow
        if not shadow.shadowing:
            shadow.start(self.clock.position, self._still_held)
            self._watch_releases(True)
        missed = shadow.catch_up(event)
        if missed is None:
            if event.kind == RELEASE:  # a release changes nothing another rank sees: DeepSpeed's own, as it comes
                return
            shadow.discard()
            self._invalidate()
            self._set_phase(TracePhase.LEFT)
            return
        if not self.rest_queued and torch._C._current_graph_task_id() != -1:
            # What the recorded backward makes after this rank's last event: at the end of this backward, inside it
            # (its module entries wake the optimizer's walk, which asks autograd what this backward reaches).
            self.rest_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._shadow_the_rest)
        self._make(missed)

    def _make(self, events: list[Event]) -> None:
        """Make ``events`` as DeepSpeed's hooks would, without the compute: through the whole coordinator (the other
        fixes' hooks too), on the plain path of a step that follows the recorded order."""
        self._set_phase(TracePhase.FOLLOWING)
        try:
            for kind, module_id, forward in events:
                module = self.modules[module_id][1]
                if kind == FETCH:
                    self.hooks.fetch_sub_module(module, forward)
                else:
                    self.hooks.release_sub_module(module, forward)
        finally:
            self._set_phase(TracePhase.SHADOWING)

    def _shadow_the_rest(self) -> None:
        if self.phase is TracePhase.SHADOWING:
            self._make(self.shadow.rest())

    def _still_held(self, event: Event) -> bool:
        """Whether ``event``'s module (a release) still holds its parameters as fetched on this rank."""
        module = self.modules[event.module][1]
        return any(event.module in p.ds_active_sub_modules for p in module_params(module))

    def leave(self, module: ZeROModule, position: int) -> None:
        """This rank's entry of ``module`` at ``position`` left the recorded order, and no shadow gets it back: every
        rank must have left it at the same module (agreed through the store), else each raises."""
        self._set_phase(TracePhase.UNRECORDED)
        timeout = self.session.options.module_order_timeout
        ids = self.ranks.meet(self.group, f"module_order/{self.forwards}/{position}", module.ds_id, timeout)
        if ids is None:
            expected = self.recorded[position] if position < len(self.recorded) else None
            raise RankDivergenceError(_left_alone_message(self.names, module, expected, timeout))
        if len(set(ids)) > 1:
            raise RankDivergenceError(_divergence_message(self.names, ids))
        if self.clock.follower is not None:
            self.clock.follower.left_order()

    def entered(self, module: ZeROModule, forward: bool) -> None:
        """A module entry while the ranks agree on entries (recording): recorded for the shadow, and agreed on before
        its gather."""
        self.shadow.record(Event(FETCH, module.ds_id, forward))
        # Modules whose parameters are all zero-element gather nothing: no agreement either.
        params = [p for p in module_params(module) if p.ds_numel > 0] if forward else None
        if params:
            self.group = params[0].ds_process_group
            self._agree_on_module(module.ds_id, params)

    # -- a release (DeepSpeed's release_sub_module) ----------------------------------------------------------------

    def release(self, submodule: ZeROModule, forward: bool) -> None:
        """DeepSpeed's release of ``submodule``, with what the protocol adds: the shadow's catch-up or record, kept
        parameters it shares held, and the lockstep's whole modules and settlement."""
        phase = self.phase
        if phase is TracePhase.SHADOWING:
            self.catch_up(Event(RELEASE, submodule.ds_id, forward))
        elif phase in AGREED_ENTRIES and module_params(submodule):  # a release without parameters changes nothing
            self.shadow.record(Event(RELEASE, submodule.ds_id, forward))
        # While DeepSpeed records it releases persistent parameters too: a kept one that this module shares (a weight
        # tied to a module some ranks skip) stays gathered, or the kept module would read it released on its ranks.
        kept = self.kept
        shared = [p for p in module_params(submodule) if p.ds_persist and p in kept] if kept else []
        for param in shared:
            param.ds_active_sub_modules.add(_KEPT)
        try:
            self.stock.release_sub_module(submodule, forward)
        finally:
            for param in shared:
                param.ds_active_sub_modules.discard(_KEPT)
        if forward and submodule in self.wholes:
            self._leave_whole([submodule])
        if forward and self.phase is TracePhase.LOCKSTEP and submodule.ds_id == self.root_id:
            self._settle_divergence()

    # -- reads outside a module's entry ----------------------------------------------------------------------------

    def agree_on_read(self, owner: ZeROModule, param: ZeROParameter) -> None:
        """A recording forward reads ``param`` of ``owner`` outside ``owner``'s entry. Not gathered: DeepSpeed is about
        to gather it on this rank alone, so the ranks agree on it first, as on an entry. Gathered only because the
        lockstep gathered ``owner`` whole for this rank: registered with the module running, as DeepSpeed's access
        registers what it gathers where the ranks agree."""
        if self.phase not in AGREED_ENTRIES or param.ds_numel == 0 or not hasattr(owner, "ds_id"):
            return
        stack = parameter_offload.FWD_MODULE_STACK
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            # Before ``owner`` ran (minicpmv4_6's text model, gathered whole while the image rank is in the tower,
            # reads ``conv1d.weight`` without entering ``conv1d``); else DeepSpeed's access would not gather it either.
            if owner.ds_id not in self.inside or param.ds_persist or owner in stack:
                return
        else:
            self.group = param.ds_process_group
            self._agree_on_module(read_of(owner.ds_id), [param])
        self.read.add(owner.ds_id)
        if param.ds_status == ZeroParamStatus.AVAILABLE and stack:
            # Gathered by the lockstep, so DeepSpeed's access will not register it with the module running, as it does
            # with what it gathers itself (that module's backward gathers it again): registered here instead, and
            # taken back at the end of the forward where not every rank read it (its module is kept gathered then).
            # Once per reader: a forward may read it again (Mllama's ``patch_embedding.weight.dtype``, then
            # ``.device``), and a registration is a dictionary entry, taken back once.
            reader = stack[-1]
            if id(param) not in getattr(reader, "_external_params", {}):
                register_external_parameter(reader, param)
                self.served_reads.append((reader, owner, param))

    # -- the lockstep ----------------------------------------------------------------------------------------------

    def _all_ints(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order (a collective)."""
        return [row[0] for row in self.ranks.all_gather(self.group, [value])]

    def _agree_on_module(self, announcement: int, params: Sequence[ZeROParameter] = ()) -> None:
        """Before this rank gathers ``params`` of the module announced (an entry, or ``read_of`` one; ``END``: after
        its forward), in a recording forward."""
        module_id = module_of(announcement)
        if self.ranks.world_size(self.group) < 2:
            return
        if module_id in self.inside and all(p.ds_status != ZeroParamStatus.NOT_AVAILABLE for p in params):
            return  # gathered whole for this rank already
        while (chosen := module_to_gather(announced := self._all_ints(announcement), self.order)) is not None:
            # A backward's gathers follow autograd, not this rule: a divergence there (a recomputed forward) stops.
            if not self.find_skipped or torch._C._current_graph_task_id() != -1:
                raise RankDivergenceError(_divergence_message(self.names, list(map(module_of, announced))))
            self._set_phase(TracePhase.LOCKSTEP)
            self._watch_releases(True)  # the root's release settles it
            # The whole module, its children included: a forward may read a child's weight before calling it, and
            # the ranks entering it gather nothing more inside.
            name, module = self.modules[chosen]
            self._gather_alike([p for p in module.parameters() if p.ds_numel > 0], chosen == module_id, name)
            if chosen == module_id:
                self.wholes.append(module)
                self.inside = {*self.inside, *(m.ds_id for m in module.modules() if hasattr(m, "ds_id"))}
                return

    def _leave_whole(self, modules: list[ZeROModule]) -> None:
        """Out of ``modules`` gathered whole for this rank: what their children's releases left gathered goes too,
        so every rank holds the same again."""
        self.wholes = [m for m in self.wholes if m not in modules]
        self.inside = {m.ds_id for whole in self.wholes for m in whole.modules() if hasattr(m, "ds_id")}
        idle = [p for module in modules for p in module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE
                and not p.ds_active_sub_modules and not p.ds_persist]
        if idle:
            idle[0].partition(param_list=idle)

    def _gather_alike(self, params: list[ZeROParameter], entering: bool, name: str) -> None:
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
        self._agree_on_module(END)
        self._set_phase(TracePhase.UNRECORDED)
        self._leave_whole(self.wholes)  # modules only read, never entered
        if not self.kept:
            self._watch_releases(False)
        entered, read, runs = self._entered_by_rank()
        skipped = skipped_modules(entered, self.alternatives, read, runs)
        # A read some ranks made only keeps its module gathered (``skipped``): the reading module's fetch list is the
        # same on every rank again.
        everyone = set.intersection(*read)
        for reader, owner, param in self.served_reads:
            if self.modules[owner.ds_id][0] not in everyone:
                unregister_external_parameter(reader, param)
        self.served_reads = []
        by_name = {name: m for name, m in self.modules.values()}
        modules = {name: by_name[name] for name in skipped}
        if modules:
            self.keep_gathered(modules, "found: some ranks skipped them in a forward", gather_now=True)
        if not self.stock.is_invalid_trace():
            self.trace_left()  # this forward's order differs between the ranks: record it again

    def _entered_by_rank(self) -> tuple[list[set[str]], list[set[str]], list[dict[str, int]]]:
        """Per rank, the names of the modules this recording forward entered, of those whose parameters it read
        from outside, and how often it entered each (a collective of one byte per module)."""
        mine = [0] * len(self.order)
        for i, runs in collections.Counter(self.recording).items():
            mine[self.order[i]] = ENTERED | min(runs, MAX_RUNS) << RUNS_SHIFT
        for i in self.read:
            mine[self.order[i]] |= READ
        names = [name for name, _ in self.modules.values()]
        everyone = self.ranks.all_gather(self.group, mine, bits=8)
        return ([{names[i] for i, flags in enumerate(row) if flags & ENTERED} for row in everyone],
                [{names[i] for i, flags in enumerate(row) if flags & READ} for row in everyone],
                [{names[i]: flags >> RUNS_SHIFT for i, flags in enumerate(row) if flags & ENTERED} for row in everyone])


def _size(params: list[ZeROParameter]) -> str:
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


def _left_alone_message(names: dict[int, str], module: ZeROModule, expected: int | None, timeout: float) -> str:
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


__all__ = ["AGREED_ENTRIES", "Coordinator", "Follower", "ModuleClock", "ModuleOrder", "TracePhase", "module_params"]
