"""ZeRO-3's module-order protocol replayed in one process: the coordinator's real methods, one thread per rank.

Each rank runs ``AgreesOnModulesWhileRecording`` over :class:`StockCoordinator`, a stand-in for DeepSpeed's
``PartitionedParameterCoordinator`` that keeps what the protocol depends on (its trace modes, the fetch and release
of a module's parameters, persistent parameters released only while it records), on a real ``nn.Module`` whose
parameters carry ZeRO-3's ``ds_*`` attributes and whose parameter dictionaries are DeepSpeed's ``ZeROOrderedDict``
(so a read goes through DeepSpeed's access, and in recording forwards through safe_zero's). Every gather of
parameters meets the other ranks' gathers, and every collective and store wait of the protocol goes through the
session's ``Ranks``, each rank's of one ``safe_zero.ranks.ReplayWorld``: a rank left in a collective the others never
make, or gathering other parameters than theirs, fails the replay (gloo aborts there; NCCL hangs or computes wrong).

A forward is a list of events per rank: ``"name"`` (the module's forward runs, with its own parameters),
``("name", [...])`` (the events inside it), ``("read", "owner", "weight")`` (the running module reads a parameter of
``owner`` without entering it). Its backward (run inside autograd, as DeepSpeed's hooks are) gathers each module the
rank ran, in reverse, and checks that every parameter that module used is gathered then: else autograd accumulates
into a released weight. The real-rank tests in ``test_gradless_params_ranks.py`` remain the end-to-end check.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from deepspeed.runtime.zero import parameter_offload
from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, _init_external_params
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
from torch import nn

from safe_zero.errors import RankDivergenceError
from safe_zero.fixes.gradless.module_order import AgreesOnModulesWhileRecording
from safe_zero.fixes.gradless.order import ModuleClock, TracePhase
from safe_zero.options import SafeZeroOptions
from safe_zero.ranks import Hang, ReplayRanks, ReplayWorld
from safe_zero.session import Session, state_of

AVAILABLE, NOT_AVAILABLE = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE


class StockCoordinator:
    """What ``AgreesOnModulesWhileRecording`` calls of DeepSpeed's coordinator (``partitioned_param_coordinator.py``):
    the trace (invalid, recording, complete; compared across ranks when a recording completes), fetch and release
    (no prefetch; persistent parameters are released too while recording, and only then)."""

    def __init__(self) -> None:
        self.mode, self.trace, self.order, self.step_id = "invalid", [], [], 0
        self.collectives: ReplayRanks | None = None  # set by the replay

    def is_record_trace(self) -> bool:
        return self.mode == "record"

    def is_complete_trace(self) -> bool:
        return self.mode == "complete"

    def is_invalid_trace(self) -> bool:
        return self.mode == "invalid"

    def reset_step(self) -> None:
        if self.mode != "complete":
            traces = self.collectives.collective("trace", [m.ds_id for m in self.trace])
            if any(t != traces[0] for t in traces):
                raise RuntimeError("Detected a disagreement on list contents")
            self.order, self.mode = (list(self.trace), "complete") if self.mode == "record" else ([], "record")
        self.trace, self.step_id = [], 0

    def _invalidate_trace(self) -> None:
        self.mode, self.trace, self.order = "invalid", [], []

    def trace_prologue(self, sub_module: nn.Module) -> None:
        if self.mode == "complete" and (self.step_id >= len(self.order) or self.order[self.step_id] is not sub_module):
            self._invalidate_trace()

    def record_module(self, sub_module: nn.Module) -> None:
        if self.mode == "record":
            self.trace.append(sub_module)

    def fetch_sub_module(self, current_submodule: nn.Module, forward: bool) -> None:
        params = list(iter_params(current_submodule))
        for p in params:
            p.ds_active_sub_modules.add(current_submodule.ds_id)
        missing = [p for p in params if p.ds_status == NOT_AVAILABLE]
        if missing:
            missing[0].all_gather(param_list=missing)
        self.step_id += 1

    def release_sub_module(self, submodule: nn.Module, forward: bool = False) -> None:
        free, recording = [], self.mode != "complete"
        for p in iter_params(submodule):
            p.ds_active_sub_modules.discard(submodule.ds_id)
            if p.ds_status == AVAILABLE and not p.ds_active_sub_modules and (recording or not p.ds_persist):
                free.append(p)
        if free:
            free[0].partition(param_list=free)


class Replayed(AgreesOnModulesWhileRecording, StockCoordinator):
    """safe_zero's coordinator mixin on the stand-in."""


def _zero3(model: nn.Module, collectives: ReplayRanks, persistent: bool) -> None:
    """Give ``model`` what ZeRO-3's ``Init`` and hooks give a model: ``ds_*`` on modules and parameters (each
    parameter partitioned, or persistent and gathered), DeepSpeed's parameter dictionaries, external parameters."""
    for ds_id, module in enumerate(model.modules()):
        module.ds_id = ds_id
        _init_external_params(module)
    parameter_offload._inject_parameters(model, ZeROOrderedDict)
    for ds_id, param in enumerate(model.parameters()):
        param.ds_id, param.ds_numel, param.ds_persist = ds_id, param.numel(), persistent
        param.ds_status = AVAILABLE if persistent else NOT_AVAILABLE
        param.ds_active_sub_modules, param.ds_process_group = set(), "dp"

        def all_gather(param_list: list[nn.Parameter] | None = None, param: nn.Parameter = param) -> None:
            params = param_list or [param]
            collectives.collective("gather", sorted(p.ds_id for p in params), alike=True)
            for p in params:
                p.ds_status = AVAILABLE

        def partition(param_list: list[nn.Parameter] | None = None, param: nn.Parameter = param) -> None:
            for p in param_list or [param]:
                p.ds_status = NOT_AVAILABLE

        param.all_gather, param.partition = all_gather, partition


class ThreadStack(threading.local):
    """DeepSpeed's ``FWD_MODULE_STACK`` (a global list), one per rank's thread."""

    def __init__(self) -> None:
        self.stack: list[nn.Module] = []

    def __getitem__(self, i: int) -> nn.Module:
        return self.stack[i]

    def __contains__(self, module: object) -> bool:
        return any(module is m for m in self.stack)

    def __bool__(self) -> bool:
        return bool(self.stack)


class Follower:
    """A planner following the module clock (``order.Follower``): where a backward's entry may hand over."""

    def __init__(self, wake_at: int = 7) -> None:
        self.wake_at, self.wake_task = wake_at, -2
        self.boundaries: list[tuple[int, int]] = []

    def at_module(self, position: int, task: int) -> None:
        self.boundaries.append((position, task))

    def left_order(self) -> None:
        pass


class InBackward(torch.autograd.Function):
    """Runs ``fn`` inside an autograd backward, where DeepSpeed's backward hooks run (a graph task is current)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Any) -> torch.Tensor:
        ctx.fn = fn
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fn()
        return grad, None


@dataclass
class Rank:
    """One rank of a replay: its coordinator, what its forwards used, and what it did."""

    rank: int
    coordinator: Replayed
    model: nn.Module
    collectives: ReplayRanks
    follower: Follower
    error: BaseException | None = None
    uses: list[tuple[nn.Module, nn.Parameter]] = field(default_factory=list)
    ran: list[nn.Module] = field(default_factory=list)
    tasks: list[int] = field(default_factory=list)  # each backward's autograd task

    def modules(self) -> dict[str, nn.Module]:
        return dict(self.model.named_modules())

    def enter(self, name: str, inside: list[Any] = ()) -> None:
        """DeepSpeed's pre- and post-forward hooks of module ``name`` around its forward."""
        module, coordinator = self.modules()[name], self.coordinator
        parameter_offload.FWD_MODULE_STACK.stack.append(module)
        coordinator.trace_prologue(module)
        if coordinator.is_record_trace():
            coordinator.record_module(module)
        coordinator.fetch_sub_module(module, forward=True)
        for param in module.parameters(recurse=False):
            self.use(module, param)
        self.events(inside)
        parameter_offload.FWD_MODULE_STACK.stack.pop()
        coordinator.release_sub_module(module, forward=True)
        self.ran.append(module)

    def use(self, module: nn.Module, param: nn.Parameter) -> None:
        assert param.ds_status == AVAILABLE, f"rank {self.rank}: `{module.ds_id}` computes with a released parameter"
        self.uses.append((module, param))

    def events(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, str):
                self.enter(event)
            elif event[0] == "read":
                _, owner, name = event
                param = self.modules()[owner]._parameters[name]  # DeepSpeed's access, or safe_zero's
                self.use(parameter_offload.FWD_MODULE_STACK[-1], param)
            else:
                self.enter(*event)

    def step(self, forward: list[Any]) -> None:
        coordinator = self.coordinator
        self.uses, self.ran = [], []
        coordinator.reset_step()
        for d in self.coordinator._safe_zero.module_order.dicts:
            d._in_forward = True  # the engine's forward
        self.enter("", forward)
        for d in self.coordinator._safe_zero.module_order.dicts:
            d._in_forward = False
        loss = InBackward.apply(torch.ones(1, requires_grad=True), self.backward)
        loss.sum().backward()

    def backward(self) -> None:
        """DeepSpeed's pre- and post-backward hooks of each module this forward ran, in reverse; each module's
        parameters and those registered with it are gathered then, and everything its forward used must be."""
        coordinator = self.coordinator
        self.follower.wake_task = torch._C._current_graph_task_id()
        self.tasks.append(self.follower.wake_task)
        for module in reversed(self.ran):
            coordinator.trace_prologue(module)
            if coordinator.is_record_trace():
                coordinator.record_module(module)
            coordinator.fetch_sub_module(module, forward=False)
            for reader, param in self.uses:
                if reader is module and param.ds_status != AVAILABLE:
                    raise AssertionError(f"rank {self.rank}: the backward of `{module.ds_id}` accumulates into a "
                                         f"released parameter #{param.ds_id}")
            coordinator.release_sub_module(module, forward=False)


def replay(build: Any, forwards: list[list[list[Any]]], persistent: bool = False, **options: Any) -> list[Rank]:
    """``forwards[rank][step]`` on one ``Replayed`` coordinator per rank over ``build()``, each rank in a thread."""
    world = ReplayWorld(len(forwards))
    ranks = []
    for rank in range(len(forwards)):
        collectives = world.rank(rank)
        coordinator = Replayed.__new__(Replayed)
        state_of(coordinator, Session(options=SafeZeroOptions(**options), ranks=collectives))
        coordinator.__init__()
        coordinator.collectives = collectives
        order = coordinator._safe_zero.module_order
        model = build()
        _zero3(model, collectives, persistent)
        order.know_model(model, [], order.session.options.find_optional_modules)
        follower = Follower()
        order.clock.follow(follower)
        ranks.append(Rank(rank, coordinator, model, collectives, follower))

    def run(r: Rank) -> None:
        try:
            for forward in forwards[r.rank]:
                r.step(forward)
        except BaseException as error:  # noqa: BLE001  (reported per rank, as the real rig does)
            r.error = error

    # DeepSpeed's access logs through torch.distributed, which no replay initializes.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parameter_offload, "FWD_MODULE_STACK", ThreadStack())
        patch.setattr(parameter_offload, "print_rank_0", lambda *args, **kwargs: None)
        threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
    return ranks


def check(ranks: list[Rank]) -> None:
    for r in ranks:
        if r.error is not None:
            raise r.error


def kept(r: Rank) -> set[str]:
    names = {id(m): name for name, m in r.model.named_modules()}
    ids = r.coordinator._safe_zero.module_order.kept_modules
    return {name for i, name in names.items() if i in ids and name.rpartition(".")[0] not in
            {names[j] for j in ids}}


# -- models (the shapes of tests/support/models.py and of the zoo's failures) ------------------------------------------


class Tower(nn.Module):
    """``tower`` runs on image ranks only; ``mix`` (registered before it) reads ``mix.conv.weight`` without entering
    ``conv`` (Qwen3.5's gated delta net); ``patch`` has no parameters of its own and reads ``patch.proj.weight``
    before calling ``proj`` (Qwen2-VL's patch embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(2, 2)
        self.mix = nn.Module()
        self.mix.scale = nn.Parameter(torch.ones(2))
        self.mix.conv = nn.Linear(2, 2)
        self.mix.out = nn.Linear(2, 2)
        self.patch = nn.Module()
        self.patch.proj = nn.Linear(2, 2)
        self.tower = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.head = nn.Linear(2, 2)


TOWER = [("tower", ["tower.0", "tower.1"])]
PATCH = [("patch", [("read", "patch.proj", "weight"), "patch.proj"])]
MIX = [("mix", [("read", "mix.conv", "weight"), "mix.out"])]


def forwards(image: list[Any], text: list[Any], world_size: int, steps: int = 3) -> list[list[list[Any]]]:
    """Images on even ranks: ``image`` there, ``text`` on the odd ones, every step."""
    return [[image if rank % 2 == 0 else text for _ in range(steps)] for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("shape", ["tower", "tower-reads", "tower-whole-reads"])
def test_ranks_that_skip_a_tower_train_on_with_it_kept_gathered(shape, persistent, world_size):
    text = ["inp", *MIX, "head"]
    image = {"tower": ["inp", *TOWER, *MIX, "head"],
             "tower-reads": ["inp", *PATCH, *TOWER, *MIX, "head"],
             # mix comes before the tower in named_modules: the text ranks run it gathered whole, the others later
             "tower-whole-reads": ["inp", *TOWER, *MIX, "head"]}[shape]
    ranks = replay(Tower, forwards(image, text, world_size), persistent=persistent)
    check(ranks)
    for r in ranks:
        assert kept(r) == ({"tower", "patch"} if shape == "tower-reads" else {"tower"}), kept(r)
        assert r.coordinator._safe_zero.module_order.phase is TracePhase.FOLLOWING
        # the third step follows the recorded order: no collective of the protocol, the trace complete
        assert r.coordinator.is_complete_trace()


def test_ranks_that_agree_make_one_agreement_per_module_in_the_first_forward_only():
    text = ["inp", *MIX, "head"]
    ranks = replay(Tower, forwards(text, text, 2))
    check(ranks)
    for r in ranks:
        # inp, mix, mix.out, head (the modules with parameters of their own) and the read of mix.conv.weight
        assert r.collectives.count["all_gather/1"] == 5
        assert kept(r) == set()


def test_a_rank_that_skips_a_module_after_the_recorded_order_shadows_it():
    """After two steps alike, rank 1 skips ``mix`` (DeepSpeed's trace is complete): it makes ``mix``'s gathers,
    forward and backward, without running it, so every gather meets the others'; nothing is kept gathered and no
    store wait is made."""
    alike = ["inp", *MIX, "head"]
    ranks = replay(Tower, [[alike] * 4, [alike, alike, ["inp", "head"], alike]], module_order_timeout=0.2)
    check(ranks)
    for r in ranks:
        assert r.coordinator.is_complete_trace() and kept(r) == set()
        assert r.coordinator._safe_zero.module_order.shadow.recorded


def test_a_rank_that_skips_the_first_module_shadows_its_backward_at_the_end():
    """``inp`` runs first, so its backward comes last: what rank 1 skipped there it makes at the end of its backward
    (an autograd callback, inside the backward)."""
    alike = ["inp", *MIX, "head"]
    ranks = replay(Tower, [[alike] * 3, [alike, alike, [*MIX, "head"]]], module_order_timeout=0.2)
    check(ranks)
    for r in ranks:
        assert r.coordinator.is_complete_trace() and kept(r) == set()
        assert r.coordinator._safe_zero.module_order.shadow.recorded


def test_a_rank_that_runs_a_module_the_recorded_order_does_not_have_stops_naming_the_modules():
    """After two steps alike without ``mix``, rank 1 runs it: no shadow covers that. It posts to the store, no other
    rank does, and it raises instead of hanging in its next gather (rank 0 is left waiting, as it would be)."""
    alike = ["inp", "head"]
    ranks = replay(Tower, [[alike] * 3, [alike, alike, ["inp", *MIX, "head"]]], module_order_timeout=0.2)
    assert isinstance(ranks[1].error, RankDivergenceError), ranks[1].error
    assert "`head`" in str(ranks[1].error) and "`mix`" in str(ranks[1].error)
    assert "Join([engine])" in str(ranks[1].error)  # a rank that ran out of batches looks the same from here
    assert isinstance(ranks[0].error, Hang)


def test_ranks_that_leave_the_recorded_order_alike_record_it_again():
    alike, short = ["inp", *MIX, "head"], ["inp", "head"]
    ranks = replay(Tower, [[alike, alike, short, short, short]] * 2)
    check(ranks)
    for r in ranks:
        assert r.coordinator.is_complete_trace() and kept(r) == set()


def test_the_module_clock_inlined_in_the_fetch_moves_as_module_clock_tick():
    """``fetch_sub_module`` inlines ``ModuleClock.tick`` (it runs per module entry): at each module entry of a
    backward the follower is told where it may hand over exactly as ``tick`` tells it."""
    text = ["inp", *MIX, "head"]
    ranks = replay(Tower, forwards(text, text, 1, steps=2))
    check(ranks)
    r = ranks[0]
    reference, follower = ModuleClock(), Follower()
    reference.follow(follower)
    for task in r.tasks:
        reference.position = 0
        for _ in r.ran:  # the forward's entries, then the backward's
            reference.tick(-1)
        follower.wake_task = task
        for _ in r.ran:
            reference.tick(task)
    assert r.follower.boundaries and r.follower.boundaries == follower.boundaries


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_weight_read_twice_in_a_tower_gathered_whole_is_registered_once(world_size):
    """Issue 48's step-1 regression (Mllama with partitioned parameters: its vision model reads
    ``self.patch_embedding.weight.dtype``, then ``.device``, before calling ``patch_embedding``). The lockstep gathered
    the tower whole for the image ranks, so each read registers the weight with the running module; registered twice,
    it was taken back twice where the text ranks did not read it: ``unregister_external_parameter`` raised
    ``RuntimeError: Parameter is not a registered external parameter of module.`` on the image ranks."""
    read = ("read", "tower.0", "weight")
    image = ["inp", ("tower", [read, read, "tower.0", "tower.1"]), *MIX, "head"]
    ranks = replay(Tower, forwards(image, ["inp", *MIX, "head"], world_size))
    check(ranks)
    for r in ranks:
        assert kept(r) == {"tower"}, kept(r)
        assert r.coordinator.is_complete_trace()
        # what the lockstep registered is taken back: the tower's weight is no external parameter of anything
        assert all(id(r.modules()["tower.0"].weight) not in m._external_params for m in r.model.modules())
