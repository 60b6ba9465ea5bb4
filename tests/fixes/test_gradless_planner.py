"""Replays of the rank agreement: two or three ranks in one process, each fed one rank's recorded events.

The first backward's hooks must fire in one relative order on the ranks that reach the same parameters (stock
DeepSpeed needs that too; what they reach may differ): the agreement hands those over as they fire. From the second
backward on, any order: the ranks walk one order merged from every rank's first one.

Each rank runs in a thread with a fake :class:`~safe_zero.fixes.gradless.planner.Optimizer` whose collectives are
``safe_zero.ranks.ReplayWorld``'s: they meet the other ranks' (a rank left in a collective the others never make
fails the replay, as a hang would). A rank is the stage mixin itself
(``ReduceInOneOrderStage12``, ``ReduceInOneOrderStage3``) over :class:`DeepSpeedSide`, a stand-in for DeepSpeed's
optimizer whose hook body records what it is handed: the replays call the mixins' own hooks, their in-order fast path
included, with ``torch._C._current_graph_task_id`` answering the rank's autograd task. ``fast=False`` replays the
same events on the bare :class:`Planner` (every hook through ``Planner.hook``), which the fast path must match.

Every replay checks what the real ranks need (docs/rank_agreement.md): every rank hands DeepSpeed the same
parameters in the same sequence, each once per backward and with a gradient, zeros exactly where its own backward did
not reach one, and on ZeRO-3 between the same module gathers. The real-rank, DDP-exact tests in
``test_gradless_params_ranks.py`` remain the end-to-end check.

A script is one list of events per backward per rank: a parameter's name (its gradient hook fires), ``"~name"`` (its
hook fires without a gradient), ``"+name"`` (ZeRO-3 tiled compute: one of several hooks of that parameter in this
backward, not its last, which DeepSpeed does not bucket), ``"m"`` (the backward enters a module: the clock moves,
that module's gathers follow), ``"nested"`` (what follows runs in a nested autograd task: reentrant checkpointing),
``"leave"`` (every rank left the recorded module order here).
"""

from __future__ import annotations

import contextlib
import inspect
import random
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

from safe_zero.errors import RankDivergenceError
from safe_zero.fixes.gradless import planner as planning
from safe_zero.fixes.gradless import stage3 as stage3_module
from safe_zero.fixes.gradless import stage12 as stage12_module
from safe_zero.fixes.gradless.adapter import WHY, Gradless
from safe_zero.fixes.gradless.order import ModuleClock
from safe_zero.fixes.gradless.planner import FIRED, HELD, UNUSED, Mode, Planner, WalkPhase
from safe_zero.ranks import Hang, ReplayRanks, ReplayWorld
from safe_zero.fixes.gradless.stage3 import ReduceInOneOrderStage3
from safe_zero.fixes.gradless.stage12 import ReduceInOneOrderStage12

#: The modules a forward enters before its backward begins (ZeRO-3 scripts).
FORWARD_MODULES = 3
OUTER, NESTED = 1, 2


class Param(str):
    """One rank's parameter: its name (equal to the other ranks' of that name), and what DeepSpeed reads of it."""

    #: Its gradient in this backward (``GRADIENT``, ``ZEROS``), ``None`` before its hook or a zero fill gives one.
    grad: Any = None
    #: ZeRO-3 tiled compute: ``False`` during a hook of it that is not its last in this backward.
    ds_grad_is_ready = True


GRADIENT, ZEROS = "its gradient", "zeros"


@dataclass
class RankOptimizer:
    """One rank's planner ``Optimizer``: ``reach`` is what its running backward reaches (its hooks' parameters);
    ``ranks.kinds`` the collectives it made."""

    ranks: ReplayRanks
    params: list[Param]
    reach: set[str] = field(default_factory=set)
    nested_warnings: int = 0
    asked: int = 0  # how often the planner asked what the running backward reaches

    def agreed_groups(self) -> list[tuple[Any, list[Param]]]:
        return [("dp", list(self.params))]

    def ordered_groups(self) -> list[tuple[Any, list[Param]]]:
        return [("dp", list(self.params))]

    def reached(self, params: list[Param]) -> list[bool]:
        self.asked += 1
        return [p in self.reach for p in params]

    def nested_backward(self) -> None:
        self.nested_warnings += 1


@dataclass
class Replay:
    """What one rank did: ``handed`` what every rank must do alike (hand-overs and, on ZeRO-3, gathers at their
    clock), ``events`` the same with its own hooks, ``reasons`` per backward each hand-over's why."""

    handed: list[tuple] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)
    reasons: list[dict[str, int]] = field(default_factory=list)
    error: BaseException | None = None
    backend: RankOptimizer | None = None
    planner: Planner | None = None
    clock: ModuleClock | None = None
    #: The mixin whose hooks this rank runs (``None``: the bare planner's, ``fast=False``).
    optimizer: Any = None
    left: bool = False  # this backward left the recorded module order (ZeRO-3): its order cannot be walked


def _hand(replay: Replay, handovers: list, clock: ModuleClock | None) -> None:
    for param, _, reason in handovers:
        if not param.ds_grad_is_ready:  # DeepSpeed buckets only a parameter's last hook of a backward
            replay.events.append(("accumulate", param))
            continue
        at = None if clock is None else clock.position
        replay.handed.append(("reduce", param, at))
        replay.events.append(("reduce", param, at))
        assert param not in replay.reasons[-1], f"{param} handed over twice in one backward"
        replay.reasons[-1][param] = reason


class DeepSpeedSide:
    """What the stage mixins call of DeepSpeed's optimizer: its hook body records the hand-over, which must come with
    a gradient (the stage's own zeros where the parameter has none); its why, for :func:`check`, is ``FIRED`` for
    the parameter's own gradient or zeros given as a hook's, ``UNUSED`` for zeros given as not used."""

    partition_gradients = True  # ZeRO-2: the hooks reduce

    def __init__(self, replay: Replay, params: list[Param]) -> None:
        self.replay = replay
        self.bit16_groups = self.fp16_groups = [params]
        #: This backward's zero gradients, each with the report's wording.
        self.why: dict[Param, str] = {}

    def _reduce(self, param: Param) -> None:
        assert param.grad is not None, f"{param} handed to DeepSpeed without a gradient"
        why = self.why.get(param)
        _hand(self.replay, [(param, (), FIRED if why is None or why == WHY[FIRED] else UNUSED)], self.replay.clock)

    def process_gradients(self, param: Param, i: int) -> None:
        self._reduce(param)

    def reduce_ready_partitions_and_remove_grads(self, param: Param, *args: Any) -> None:
        self._reduce(param)

    def enter_backward(self) -> None:
        pass

    def independent_gradient_partition_epilogue(self) -> None:
        pass


class ZerosRecorded:
    """First base of a replayed rank: the stage's zero gradients (torch tensors there) as ``ZEROS``, with why."""

    why: dict[Param, str]

    def _zero_fill(self, wanted: Any) -> None:
        for param, why in wanted:
            param.grad = ZEROS
            self.why[param] = why


def _replayed(mixin: type) -> type:
    """A rank: the stage mixin ``mixin`` over :class:`DeepSpeedSide`, built by the stand-in's constructor."""
    return type(f"Replayed{mixin.__name__}", (ZerosRecorded, mixin, DeepSpeedSide),
                {"__init__": DeepSpeedSide.__init__})


#: Per thread, the autograd task its rank's hooks run in (-1: no backward runs).
_TASK = threading.local()


def _task_of_this_thread() -> int:
    return getattr(_TASK, "id", -1)


@contextlib.contextmanager
def _tasks_per_thread(mixin: type) -> Iterator[None]:
    """``torch._C._current_graph_task_id`` as the hooks of ``mixin`` and its bases call it: the task of the rank
    whose thread calls."""
    namespaces = {id(f.__globals__): f.__globals__ for klass in mixin.__mro__ for f in vars(klass).values()
                  if isinstance(f, types.FunctionType) and "_current_graph_task_id" in f.__globals__}
    saved = [(names, names["_current_graph_task_id"]) for names in namespaces.values()]
    for names, _ in saved:
        names["_current_graph_task_id"] = _task_of_this_thread
    try:
        yield
    finally:
        for names, stock in saved:
            names["_current_graph_task_id"] = stock


class BareFollower:
    """A bare planner (``fast=False``) as the clock's follower: its boundaries handed over as the mixins' would be."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay

    @property
    def wake_at(self) -> int:
        return self.replay.planner.wake_at

    @property
    def wake_task(self) -> int:
        return self.replay.planner.wake_task

    def at_module(self, position: int, task: int) -> None:
        _hand(self.replay, self.replay.planner.boundary(position, task), self.replay.clock)

    def left_order(self) -> None:
        self.replay.planner.left_order()


def _run_rank(replay: Replay, steps: list[list[str]]) -> None:
    backend, planner, clock, optimizer = replay.backend, replay.planner, replay.clock, replay.optimizer
    named = {p: p for p in backend.params}  # the planner knows a parameter by identity, as torch's by id()
    if clock is not None and optimizer is None:
        clock.follow(BareFollower(replay))
    for events in steps:
        _begin_backward(replay, events)
        task = _TASK.id = OUTER
        for event in events:
            if event == "m":
                position = clock.tick(task)
                replay.handed.append(("gather", position))
                replay.events.append(("gather", position))
            elif event == "nested":
                task = _TASK.id = NESTED
            elif event == "leave":
                planner.left_order()
                replay.left, clock.followed = True, False
            else:
                _hook(replay, named[event.lstrip("~+")], event[0], task)
        if optimizer is None:
            _hand(replay, planner.finish_backward([(p, ()) for p in backend.params]), clock)
            planner.settle_order(walkable=not replay.left)
        else:
            optimizer.independent_gradient_partition_epilogue()
        replay.handed.append(("epilogue",))
        replay.events.append(("epilogue",))
        _TASK.id = -1


def _begin_backward(replay: Replay, events: list[str]) -> None:
    """The forward (ZeRO-3: its modules on the clock) and ``engine.backward``'s entry, before autograd runs."""
    backend, clock, optimizer = replay.backend, replay.clock, replay.optimizer
    # The outer graph shows what the outer task reaches, not what a nested one will.
    outer = events[:events.index("nested")] if "nested" in events else events
    backend.reach = {e.lstrip("~+") for e in outer if e.lstrip("~+") in backend.params}
    replay.reasons.append({})
    replay.left = False
    for param in backend.params:
        param.grad = None
    if clock is not None:
        clock.position, clock.followed = 0, True
        for _ in range(FORWARD_MODULES):
            clock.tick(-1)
    if optimizer is None:
        replay.planner.begin_backward()
    else:
        optimizer.why.clear()
        _TASK.id = -1
        optimizer.enter_backward()


def _hook(replay: Replay, param: Param, kind: str, task: int) -> None:
    """``param``'s gradient hook fires (``kind``: ``"~"`` without a gradient, ``"+"`` not its last of a tiled one)."""
    replay.events.append(("hook", param))
    if kind != "~" and param.grad is None:
        param.grad = GRADIENT
    if kind == "+":
        param.ds_grad_is_ready = False
    optimizer, clock = replay.optimizer, replay.clock
    if optimizer is None:
        _hand(replay, replay.planner.hook(param, (), task, None if clock is None else clock.position,
                                          param.ds_grad_is_ready), clock)
    elif clock is None:
        optimizer.process_gradients(param, 0)
    else:
        optimizer.reduce_ready_partitions_and_remove_grads(param)
    if kind == "+":
        del param.ds_grad_is_ready


def replay(scripts: list[list[list[str]]], params: list[str], zero3: bool = False,
           late: tuple[int, ...] = (), fast: bool = True) -> list[Replay]:
    """Run ``scripts[rank][step]`` on one rank per script, in threads, the fix in ``Mode.AGREED``; every rank's
    :class:`Replay`. ``fast``: through the stage mixin's hooks (which take the in-order fast path where the planner
    offers it); else on the bare planner."""
    world = ReplayWorld(len(scripts))
    mixin = ReduceInOneOrderStage3 if zero3 else ReduceInOneOrderStage12
    replays = []
    for rank in range(len(scripts)):
        r = Replay()
        r.backend = RankOptimizer(world.rank(rank, late=rank in late), [Param(p) for p in params])
        r.clock = ModuleClock() if zero3 else None
        if fast:
            r.optimizer = _replayed(mixin)(r, r.backend.params)
            r.planner = Gradless(Mode.AGREED, r.backend, queues=not zero3, optimizer=r.optimizer, clock=r.clock)
            r.optimizer._plan(r.planner)
        else:
            r.planner = Planner(Mode.AGREED, r.backend, clocked=zero3, queues=not zero3)
        replays.append(r)

    def run(rank: int) -> None:
        try:
            _run_rank(replays[rank], scripts[rank])
        except BaseException as error:  # noqa: BLE001  (reported per rank, as the real rig does)
            replays[rank].error = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(scripts))]
    with _tasks_per_thread(mixin):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
    return replays


def check(replays: list[Replay], scripts: list[list[list[str]]], positions: bool = True) -> None:
    """Every rank handed over the same sequence (``positions``: between the same gathers), every parameter once per
    backward, and zeros exactly where its own backward did not reach it."""
    for r in replays:
        if r.error is not None:
            raise r.error
    def seen(r: Replay) -> list[tuple]:
        return r.handed if positions else [e[:2] for e in r.handed if e[0] != "gather"]

    first = seen(replays[0])
    for rank, r in enumerate(replays[1:], 1):
        assert seen(r) == first, \
            f"rank {rank} handed over\n{r.handed}\nrank 0\n{replays[0].handed}"
    for rank, r in enumerate(replays):
        for step, reasons in enumerate(r.reasons):
            assert set(reasons) == set(r.backend.params), (rank, step, reasons)
            hooked = {event.lstrip("~+") for event in scripts[rank][step]}
            for param, reason in reasons.items():  # HELD: its gradient where it has one, else zeros
                assert reason == HELD or (reason == FIRED) == (param in hooked), \
                    f"rank {rank} step {step}: {param} handed over as {'its gradient' if reason == FIRED else 'zeros'}"


def sequence(r: Replay, step: int) -> list[str]:
    """The parameters ``r`` handed over in backward ``step``."""
    backwards, current = [], []
    for event in r.handed:
        if event[0] == "epilogue":
            backwards.append(current)
            current = []
        elif event[0] == "reduce":
            current.append(event[1])
    return backwards[step]


def handed_at_hook(r: Replay, step: int) -> list[str]:
    """The parameters handed over right at their own hook in backward ``step``."""
    backwards, current, last = [], [], None
    for event in r.events:
        if event[0] == "epilogue":
            backwards.append(current)
            current = []
        elif event[0] == "hook":
            last = event[1]
        elif event[0] == "reduce" and event[1] == last:
            current.append(last)
    return backwards[step]


P4 = ["a", "b", "c", "d"]


# -- ZeRO-1/2: hook order only ---------------------------------------------------------------------------------


@pytest.mark.parametrize("late", [(), (1,), (0, 1)])
def test_zero12_hooks_in_other_orders_on_each_rank_and_each_step(late):
    scripts = [[["d", "c", "b", "a"], ["a", "b", "c", "d"], ["b", "d", "a", "c"]],
               [["d", "c", "b", "a"], ["c", "d", "a", "b"], ["a", "c", "d", "b"]]]
    replays = replay(scripts, P4, late=late)
    check(replays, scripts)
    assert sequence(replays[0], 1) == ["d", "c", "b", "a"], "from the second backward on: rank 0's first hook order"
    assert [r.backend.ranks.kinds for r in replays] == [["all_reduce", "all_gather"]] * 2, "nothing after the first"


def test_zero12_a_model_every_rank_uses_in_one_order_is_handed_over_as_each_hook_fires():
    scripts = [[["d", "c", "b", "a"]] * 3] * 2
    replays = replay(scripts, P4)
    check(replays, scripts)
    for r in replays:
        assert handed_at_hook(r, 1) == handed_at_hook(r, 2) == ["d", "c", "b", "a"]


def test_zero12_a_parameter_some_rank_never_reaches_goes_as_zeros_in_its_turn():
    scripts = [[["d", "c", "b", "a"]] * 3, [["d", "c", "a"]] * 3]
    replays = replay(scripts, P4)
    check(replays, scripts)
    assert sequence(replays[0], 0) == ["d", "c", "a", "b"], "agreed: what some rank misses waits for the epilogue"
    assert sequence(replays[1], 1) == ["d", "c", "b", "a"]
    assert replays[1].events[replays[1].events.index(("hook", "c"), 8):][:5] == [
        ("hook", "c"), ("reduce", "c", None), ("hook", "a"), ("reduce", "b", None), ("reduce", "a", None)], \
        "b goes as zeros in its turn, before a"


def test_zero12_experts_that_move_between_three_ranks_every_step():
    scripts = [[[e for e in "abcd" if e in "abcd"[s % 4] + "abcd"[(s + 1) % 4]] for s in range(4)],
               [[e for e in "dcba" if e in "abcd"[(s + 2) % 4] + "abcd"[(s + 3) % 4]] for s in range(4)],
               [[e for e in "abcd" if e in "abcd"[(s + 1) % 4] + "abcd"[(s + 2) % 4]] for s in range(4)]]
    check(replay(scripts, P4, late=(2,)), scripts)


def test_zero12_reentrant_checkpointing_from_the_first_step_agrees_every_backward():
    scripts = [[["d", "c", "nested", "b", "a"]] * 3] * 2
    replays = replay(scripts, P4)
    check(replays, scripts)
    for r in replays:
        assert r.planner.nested and r.planner.order is None and r.backend.nested_warnings >= 1
        assert r.backend.ranks.kinds == ["all_reduce"] * 3, "one agreement per backward, no order"
        assert sequence(r, 2) == ["d", "c", "a", "b"], "the nested backward's parameters wait for the epilogue"


def test_zero12_reentrant_checkpointing_begun_late_stops_every_rank():
    scripts = [[["d", "c", "b", "a"], ["d", "c", "nested", "b", "a"]]] * 2
    replays = replay(scripts, P4)
    for r in replays:
        assert isinstance(r.error, RankDivergenceError) and "use_reentrant=False" in str(r.error)


def test_strict_mode_hands_each_hook_over_at_once_and_names_what_did_not_fire():
    scripts = [[["d", "c", "b", "a"]], [["a", "c"]]]
    world = ReplayWorld(2)
    for rank, events in enumerate(scripts[0] + scripts[1]):
        planner = Planner(Mode.STRICT, RankOptimizer(world.rank(rank), P4))
        planner.begin_backward()
        assert [h for e in events for h in planner.hook(e, (), OUTER)] == [(e, (), FIRED) for e in events]
        assert planner.unfired(P4) == [p for p in P4 if p not in events]
        assert planner.finish_backward([(p, ()) for p in P4]) == []
    assert world.posts == {}, "no collective"


def _random_zero12_scripts(seed: int, ranks: int, steps: int, params: list[str]) -> list[list[list[str]]]:
    """Per rank and step: a random subset of ``params`` (most of them) in an order that mostly keeps the first's."""
    rng = random.Random(seed)
    first = rng.sample(params, len(params))
    scripts = []
    for _ in range(ranks):
        backwards = []
        for _ in range(steps):
            events = [p for p in first if rng.random() < 0.8]
            for _ in range(rng.randrange(3)):  # a few hooks out of place
                if len(events) > 1:
                    events.insert(rng.randrange(len(events)), events.pop(rng.randrange(len(events))))
            backwards.append(events)
        scripts.append(backwards)
    for backwards in scripts:  # the first backward: one relative order on every rank (see the module docstring)
        backwards[0] = [p for p in first if p in backwards[0]]
    return scripts


@pytest.mark.parametrize("seed", range(12))
def test_zero12_the_in_order_fast_path_hands_over_what_the_planner_alone_does(seed):
    """The same sequence; each at the same hook but where a parameter fired ahead of its turn waits (parked): the
    fast path stops there and it goes at the next hook the planner takes, or at the epilogue."""
    params = [f"p{k}" for k in range(9)]
    scripts = _random_zero12_scripts(seed, 2 + seed % 2, 5, params)
    fast, slow = replay(scripts, params, fast=True), replay(scripts, params, fast=False)
    check(fast, scripts)
    assert [r.handed for r in fast] == [r.handed for r in slow]
    for f, s in zip(fast, slow):
        if all(len(sequence(s, step)) == len(handed_at_hook(s, step)) for step in range(len(s.reasons))):
            assert f.events == s.events, "nothing parked: each hand-over at the same hook"


def _count_hooks(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[str]]:
    """Per planner (by ``id``), the parameters whose hook went to ``Planner.hook`` (not the fast path)."""
    calls: dict[int, list[str]] = {}
    hook = Planner.hook
    monkeypatch.setattr(Planner, "hook", lambda self, param, *args:
                        calls.setdefault(id(self), []).append(param) or hook(self, param, *args))
    return calls


def test_zero12_what_only_one_rank_reached_in_the_agreeing_backward_keeps_its_place_in_the_order(monkeypatch):
    """Rank 1 uses ``a`` and ``b`` before the others, rank 0 never does: the agreed order merges both ranks'
    hook orders, so each walks it in order, and after the agreeing backward each calls the planner once per
    backward (its first hook), parking nothing."""
    calls = _count_hooks(monkeypatch)
    scripts = [[["f", "e", "d", "c"]] * 3, [["b", "a", "f", "e", "d", "c"]] * 3]
    replays = replay(scripts, P6)
    check(replays, scripts)
    assert sequence(replays[0], 1) == sequence(replays[1], 2) == ["b", "a", "f", "e", "d", "c"]
    assert calls[id(replays[0].planner)] == ["f", "e", "d", "c", "f", "f"]
    assert calls[id(replays[1].planner)] == ["b", "a", "f", "e", "d", "c", "b", "b"]
    for r in replays:
        assert r.backend.ranks.kinds == ["all_reduce", "all_gather"], "nothing after the first backward"


def test_zero12_the_fast_path_runs_past_parameters_a_rank_fires_ahead_of_the_order(monkeypatch):
    """From the second backward rank 1 also uses ``a`` and ``b``, which no rank reached in the agreeing one (the
    order has them last, by parameter index): its hooks for them fire first and park; its other hooks still go by
    the fast path, and ``a``, ``b`` go at the epilogue, in order."""
    calls = _count_hooks(monkeypatch)
    scripts = [[["f", "e", "d", "c"]] * 3, [["f", "e", "d", "c"]] + [["b", "a", "f", "e", "d", "c"]] * 2]
    replays = replay(scripts, P6)
    check(replays, scripts)
    assert sequence(replays[1], 2) == ["f", "e", "d", "c", "b", "a"]
    assert calls[id(replays[0].planner)] == ["f", "e", "d", "c", "f", "f"], "each later backward's first hook"
    assert calls[id(replays[1].planner)] == ["f", "e", "d", "c", "b", "a", "b", "a"], \
        "after the agreeing backward, only the hooks that fire ahead of the order"


@pytest.mark.parametrize("seed", range(8))
def test_merged_order_keeps_every_ranks_order_where_they_agree(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    truth = rng.sample(range(n), n)
    arrivals = [[k for k in truth if rng.random() < 0.5] for _ in range(rng.randrange(1, 4))]
    merged = planning.merge_orders(arrivals, n, key=lambda k: -k)
    assert sorted(merged) == list(range(n))
    for order in arrivals:
        assert [k for k in merged if k in order] == order
    assert merged == planning.merge_orders([list(a) for a in arrivals], n, key=lambda k: -k), "deterministic"


def test_merged_order_takes_the_lowest_key_where_the_ranks_leave_a_choice_or_contradict_each_other():
    assert planning.merge_orders([[5, 2, 0], [3, 2, 1]], 6, key=lambda k: -k) == [5, 4, 3, 2, 1, 0]
    assert planning.merge_orders([[0, 1, 2], [2, 1, 0]], 3, key=lambda k: -k) == [2, 1, 0], \
        "a contradiction: the lowest key among what is left, each time"
    assert planning.merge_orders([[1, 3]], 4, key=lambda k: (0 if k == 1 else 1, k)) == [1, 0, 2, 3]


@pytest.mark.parametrize("seed", range(6))
def test_zero12_ranks_that_reach_other_parameters_walk_the_merged_order_without_parking(seed, monkeypatch):
    """Rank-dependent routing: each rank reaches another subset of one backward order, every step. Where a later
    backward reaches only what some rank reached in the agreeing one, every hook is handed over at that hook, and
    each rank calls the planner once per later backward."""
    calls = _count_hooks(monkeypatch)
    rng = random.Random(seed)
    params = [f"p{k}" for k in range(12)]
    ranks, steps = 2 + seed % 2, 4
    scripts = [[[p for p in reversed(params) if rng.random() < 0.6] for _ in range(steps)] for _ in range(ranks)]
    seen = {p for rank in scripts for p in rank[0]}
    for rank in scripts:
        rank[1:] = [[p for p in events if p in seen] for events in rank[1:]]
    replays = replay(scripts, params)
    check(replays, scripts)
    for rank, r in enumerate(replays):
        for step in range(1, steps):
            assert handed_at_hook(r, step) == scripts[rank][step], (rank, step)
        order = r.planner.order.sequences[0]
        # After the agreeing backward: its first hook, and the first hook out of turn where it skips a parameter of
        # the order after that one (the planner then asks what the backward reaches, and the fast path skips it).
        assert len(calls.get(id(r.planner), [])) == len(scripts[rank][0]) + sum(
            1 + (events[0] == order[0] and events != order[:len(events)])
            for events in scripts[rank][1:] if events), "after the agreeing backward: once or twice per backward"


def test_zero12_in_order_hooks_after_the_first_backward_call_the_planner_once_per_backward(monkeypatch):
    calls = []
    hook = Planner.hook
    monkeypatch.setattr(Planner, "hook", lambda self, param, *args: calls.append(param) or hook(self, param, *args))
    scripts = [[["d", "c", "b", "a"]] * 3] * 2
    replays = replay(scripts, P4)
    check(replays, scripts)
    assert len(calls) == 2 * (4 + 1 + 1), "every hook of the agreeing backward, then each backward's first hook"


def test_zero12_a_backward_asks_what_it_reaches_only_at_a_hook_out_of_turn():
    """After the agreeing backward, a rank that reaches every parameter in the agreed order asks autograd nothing
    (its hooks go by the fast path); rank 1 never reaches ``b``: ``a``'s hook comes out of turn, asks, and hands
    ``b`` over as zeros before ``a``, in each backward afresh."""
    scripts = [[["d", "c", "b", "a"]] * 3, [["d", "c", "a"]] * 3]
    replays = replay(scripts, P4)
    check(replays, scripts)
    for backward in (1, 2):
        events = replays[1].events[[i for i, e in enumerate(replays[1].events) if e == ("epilogue",)][backward - 1]
                                   + 1:]
        assert events[:8] == [("hook", "d"), ("reduce", "d", None), ("hook", "c"), ("reduce", "c", None),
                              ("hook", "a"), ("reduce", "b", None), ("reduce", "a", None), ("epilogue",)]
    assert replays[0].backend.asked == 1, "the agreement's ask, in the first backward"
    assert replays[1].backend.asked == 1 + 2, "and one per later backward, at a's hook"


def test_zero12_after_asking_the_fast_path_hands_over_the_zeros_that_follow_a_hook():
    """Rank 1 never reaches ``e`` and ``b``: ``d``'s hook comes out of turn and asks, and from then on the fast path
    knows: ``c``'s hook hands ``b`` over as zeros right after ``c``, without the planner."""
    scripts = [[["f", "e", "d", "c", "b", "a"]] * 3, [["f", "d", "c", "a"]] * 3]
    replays = replay(scripts, P6)
    check(replays, scripts)
    events = replays[1].events[replays[1].events.index(("epilogue",)) + 1:]
    assert events[:12] == [("hook", "f"), ("reduce", "f", None), ("hook", "d"), ("reduce", "e", None),
                           ("reduce", "d", None), ("hook", "c"), ("reduce", "c", None), ("reduce", "b", None),
                           ("hook", "a"), ("reduce", "a", None), ("epilogue",), ("hook", "f")]


def test_zero12_a_hook_without_a_gradient_goes_as_zeros_at_that_hook():
    """Rank 1's hook of ``c`` fires without a gradient (DeepSpeed hooks a parameter autograd gave none): it goes as
    zeros at that hook, in its turn, by the fast path as by the planner."""
    scripts = [[["d", "c", "b", "a"]] * 3, [["d", "~c", "b", "a"]] * 3]
    replays = replay(scripts, P4)
    check(replays, scripts)
    for r in replays:
        assert handed_at_hook(r, 1) == handed_at_hook(r, 2) == ["d", "c", "b", "a"]
    assert replays[1].optimizer.why == {"c": WHY[FIRED]}


def test_zero12_a_hook_that_fired_late_goes_at_the_next_hook_not_at_the_epilogue():
    """Rank 1's ``d`` fires before ``e`` in the second backward: ``d`` parks, ``e`` goes by the fast path, and the
    next hook (``c``) hands over the parked ``d`` before itself; the rest go by the fast path again."""
    dense = ["f", "e", "d", "c", "b", "a"]
    scripts = [[dense] * 2, [dense, ["f", "d", "e", "c", "b", "a"]]]
    replays = replay(scripts, P6)
    check(replays, scripts)
    events = replays[1].events[replays[1].events.index(("epilogue",)) + 1:]
    assert events == [("hook", "f"), ("reduce", "f", None), ("hook", "d"), ("hook", "e"), ("reduce", "e", None),
                      ("hook", "c"), ("reduce", "d", None), ("reduce", "c", None), ("hook", "b"),
                      ("reduce", "b", None), ("hook", "a"), ("reduce", "a", None), ("epilogue",)]


# -- ZeRO-3: hook order and the module clock -------------------------------------------------------------------

#: Three modules' backward: ``m`` then the hooks of that module's parameters.
P6 = ["a", "b", "c", "d", "e", "f"]


def test_zero3_hooks_in_other_orders_inside_each_module():
    scripts = [[["m", "f", "e", "m", "d", "c", "m", "b", "a"], ["m", "e", "f", "m", "c", "d", "m", "a", "b"]] * 2,
               [["m", "f", "e", "m", "d", "c", "m", "b", "a"], ["m", "f", "e", "m", "c", "d", "m", "b", "a"]] * 2]
    replays = replay(scripts, P6, zero3=True)
    check(replays, scripts)
    assert [r.backend.ranks.kinds for r in replays] == [["all_reduce", "all_gather"]] * 2


def test_zero3_a_parameter_a_module_uses_on_some_ranks_only_goes_as_zeros_before_the_next_gather():
    """``shift``: rank 1 does not reach ``d`` from the second backward on; it goes out as zeros at the boundary of
    the module after rank 0's hook for it, before that module's gathers, on every rank alike."""
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    scripts = [[dense] * 3, [dense] + [["m", "f", "e", "m", "c", "m", "b", "a"]] * 2]
    replays = replay(scripts, P6, zero3=True)
    check(replays, scripts)
    step2 = replays[1].handed[replays[1].handed.index(("epilogue",)) + 1:]
    assert step2[:7] == [("gather", 3), ("reduce", "f", 4), ("reduce", "e", 4), ("gather", 4), ("reduce", "d", 5),
                         ("reduce", "c", 5), ("gather", 5)]


def test_zero3_a_parameter_only_one_rank_reached_first_is_due_where_that_ranks_hook_fired():
    """Rank 0 skips ``d`` in the agreeing backward, rank 1 does not: the order has ``d`` in rank 1's place, due at
    rank 1's clock, so from then on both ranks hand it over before the next module's gathers."""
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    scripts = [[["m", "f", "e", "m", "c", "m", "b", "a"], dense, dense], [dense, dense, dense]]
    replays = replay(scripts, P6, zero3=True)
    check(replays, scripts)
    for r in replays:
        assert r.handed[r.handed.index(("epilogue",)) + 1:][:10] == [
            ("gather", 3), ("reduce", "f", 4), ("reduce", "e", 4), ("gather", 4), ("reduce", "d", 5),
            ("reduce", "c", 5), ("gather", 5), ("reduce", "b", 6), ("reduce", "a", 6), ("epilogue",)]


def test_zero3_a_parameter_no_rank_reached_first_goes_at_the_epilogue():
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    scripts = [[["m", "f", "e", "m", "c", "m", "b", "a"], dense, dense]] * 2
    replays = replay(scripts, P6, zero3=True)
    check(replays, scripts)
    for r in replays:
        assert sequence(r, 1) == ["f", "e", "c", "b", "a", "d"]


@pytest.mark.parametrize("ranks_moving", [(0, 1), (1,)])
def test_zero3_a_gradient_that_moves_past_a_gather(ranks_moving):
    """In the second backward ``e``'s hook fires after the next module's gathers. Where it moves on every rank
    alike, every rank waits for it and they hand over between the same gathers; where it moves on rank 1 only,
    that rank's walk waits for it there (one sequence, later than rank 0's: what stock's sorted buckets allow)."""
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    moved = ["m", "f", "m", "e", "d", "c", "m", "b", "a"]
    scripts = [[dense, moved if rank in ranks_moving else dense, dense] for rank in range(2)]
    replays = replay(scripts, P6, zero3=True)
    check(replays, scripts, positions=len(ranks_moving) == 2)
    for rank in ranks_moving:
        step2 = replays[rank].handed[replays[rank].handed.index(("epilogue",)) + 1:]
        assert step2[:4] == [("gather", 3), ("reduce", "f", 4), ("gather", 4), ("reduce", "e", 5)]


@pytest.mark.parametrize("ranks_moving", [(0, 1), (1,)])
def test_zero3_a_gradient_that_arrives_before_a_gather_where_the_order_has_it_after(ranks_moving):
    """Rank 0's first backward had ``e``'s hook after the next module's gathers; later ``e`` arrives before them
    (on every rank, or on rank 1 only). It waits for its due clock: every rank hands it over after those gathers."""
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    moved = ["m", "f", "m", "e", "d", "c", "m", "b", "a"]
    scripts = [[moved, dense if rank in ranks_moving else moved, dense] for rank in range(2)]
    replays = replay(scripts, P6, zero3=True)
    check(replays, scripts)
    for r in replays:
        step2 = r.handed[r.handed.index(("epilogue",)) + 1:]
        assert step2[:4] == [("gather", 3), ("reduce", "f", 4), ("gather", 4), ("reduce", "e", 5)]
    for rank in ranks_moving:  # e goes as soon as the clock is due: at the next hook, as rank 0's did
        events = replays[rank].events[replays[rank].events.index(("epilogue",)) + 1:]
        assert events[events.index(("hook", "d")):][:3] == [("hook", "d"), ("reduce", "e", 5), ("reduce", "d", 5)]


def test_zero3_every_rank_leaving_the_module_order_holds_the_rest_and_agrees_again():
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    left = ["m", "f", "e", "leave", "m", "d", "c", "m", "b", "a"]
    scripts = [[dense, left, dense, dense]] * 2
    replays = replay(scripts, P6, zero3=True)
    check(replays, scripts)
    for r in replays:
        assert sequence(r, 1) == ["f", "e", "d", "c", "b", "a"]
        assert r.handed[r.handed.index(("epilogue",)) + 1:][:6] == [
            ("gather", 3), ("reduce", "f", 4), ("reduce", "e", 4), ("gather", 4), ("gather", 5), ("reduce", "d", 6)]
        assert r.backend.ranks.kinds == ["all_reduce", "all_gather", "all_reduce", "all_gather"], \
            "the step after leaving agrees again (the trace is recorded again)"
        assert r.planner.phase is WalkPhase.ORDERED


def test_zero3_reentrant_checkpointing_begun_late_stops_every_rank():
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    nested = ["m", "f", "e", "nested", "m", "d", "c", "m", "b", "a"]
    replays = replay([[dense, nested]] * 2, P6, zero3=True)
    for r in replays:
        assert isinstance(r.error, RankDivergenceError) and "nested backward" in str(r.error)


def test_zero3_three_ranks_with_parameters_each_rank_uses_on_some_steps():
    def backward(skip: str) -> list[str]:
        return [e for e in ["m", "f", "e", "m", "d", "c", "m", "b", "a"] if e != skip]

    scripts = [[backward("z"), backward("d"), backward("b"), backward("z")],
               [backward("d"), backward("z"), backward("a"), backward("d")],
               [backward("c"), backward("c"), backward("z"), backward("e")]]
    check(replay(scripts, P6, zero3=True), scripts)


def _random_zero3_scripts(seed: int, ranks: int, steps: int) -> list[list[list[str]]]:
    """Three modules of two parameters, entered last to first: per rank and step, each module's hooks (most of
    them, sometimes swapped, sometimes one moved past the next module's gathers), the same first backward order."""
    rng = random.Random(seed)
    scripts = []
    for _ in range(ranks):
        backwards = []
        for step in range(steps):
            events: list[str] = []
            for pair in (["f", "e"], ["d", "c"], ["b", "a"]):
                hooks = [p for p in pair if step == 0 or rng.random() < 0.8]
                if step and rng.random() < 0.3:
                    hooks.reverse()
                events += ["m"] + hooks
            if step and rng.random() < 0.3 and events[2] != "m":  # f's partner moves past the next gather
                events.insert(events.index("m", 1) + 1, events.pop(2))
            backwards.append(events)
        scripts.append(backwards)
    return scripts


@pytest.mark.parametrize("seed", range(12))
def test_zero3_the_in_order_fast_path_hands_over_exactly_what_the_planner_alone_does(seed):
    scripts = _random_zero3_scripts(seed, 2 + seed % 2, 5)
    fast, slow = replay(scripts, P6, zero3=True, fast=True), replay(scripts, P6, zero3=True, fast=False)
    check(fast, scripts, positions=False)
    assert [r.events for r in fast] == [r.events for r in slow], "each hand-over at the same hook and gather"


def test_zero3_in_order_hooks_after_the_first_backward_go_by_the_fast_path(monkeypatch):
    calls, entries = [], []
    hook, boundary = Planner.hook, Planner.boundary
    monkeypatch.setattr(Planner, "hook", lambda self, param, *args: calls.append(param) or hook(self, param, *args))
    monkeypatch.setattr(Planner, "boundary", lambda self, *args: entries.append(args) or boundary(self, *args))
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    replays = replay([[dense] * 3] * 2, P6, zero3=True)
    check(replays, [[dense] * 3] * 2)
    assert len(calls) == 2 * 6, "the agreeing backward's hooks only: the walk expects each next one"
    assert len(entries) == 2 * (3 + 1 + 1), \
        "every module entry of the agreeing backward, then one per backward (its walk begins): nothing else is due"


def test_zero3_a_hook_without_a_gradient_goes_as_zeros_at_that_hook():
    """Rank 1's hook of ``d`` fires without a gradient (DeepSpeed hooks a parameter autograd gave none): it goes as
    zeros at that hook, in its turn, by the fast path as by the planner."""
    dense = ["m", "f", "e", "m", "d", "c", "m", "b", "a"]
    scripts = [[dense] * 3, [["m", "f", "e", "m", "~d", "c", "m", "b", "a"]] * 3]
    replays = replay(scripts, P6, zero3=True)
    check(replays, scripts)
    assert handed_at_hook(replays[1], 2) == ["f", "e", "d", "c", "b", "a"]
    assert replays[1].optimizer.why == {"d": WHY[FIRED]}


def test_zero3_tiled_compute_keeps_each_parameters_last_hook_in_the_order():
    """Tiled compute (DeepSpeed's ``ds_grad_is_ready``): ``e`` and ``c`` hook several times in a backward, and
    DeepSpeed buckets only the last; the earlier ones go to it at once, to accumulate, and the last keeps its place."""
    tiled = ["m", "f", "+e", "+e", "e", "m", "d", "+c", "c", "m", "b", "a"]
    replays = replay([[tiled] * 3] * 2, P6, zero3=True)
    check(replays, [[tiled] * 3] * 2)
    for r in replays:
        assert handed_at_hook(r, 2) == ["f", "e", "d", "c", "b", "a"]
        assert [e[1] for e in r.events if e[0] == "accumulate"] == ["e", "e", "c"] * 3


# -- the replays have teeth: a broken planner or hook turns them red -------------------------------------------


def _mutate(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType, *edits: tuple[str, str]) -> None:
    """Replay on ``module`` (the planner, or a stage mixin's module) with ``edits`` (old, new: every occurrence) made
    to its source."""
    source = inspect.getsource(module)
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    if module is planning:  # the mixins' planner too: Gradless, over the mutated Planner
        source += "\n\n" + inspect.getsource(Gradless)
    mutant = types.ModuleType(f"mutated_{module.__name__.rsplit('.', 1)[-1]}")
    exec(compile(source, f"{mutant.__name__}.py", "exec"), mutant.__dict__)
    if module is planning:
        mutant.Mode, mutant.WalkPhase = Mode, WalkPhase  # the enums the mixins and the replays compare with
    for name in ("Planner", "Gradless", "ReduceInOneOrderStage12", "ReduceInOneOrderStage3"):
        if name in vars(mutant):
            monkeypatch.setitem(globals(), name, getattr(mutant, name))


def test_a_planner_that_ignores_the_due_clock_fails_the_replays(monkeypatch):
    _mutate(monkeypatch, planning, ("due[k] > now", "False"))
    for ranks_moving in [(0, 1), (1,)]:
        with pytest.raises(AssertionError):
            test_zero3_a_gradient_that_arrives_before_a_gather_where_the_order_has_it_after(ranks_moving)


def test_a_planner_that_waits_for_unreached_parameters_fails_the_replays(monkeypatch):
    _mutate(monkeypatch, planning, ("if reached is not None and not reached[k]:", "if False:"),
            ("elif reached is None or reached[k]:", "elif True:"), ("if reached[at]:", "if True:"),
            ("elif finish or (ask and not self.reaches(sequence, k)):", "elif finish:"))
    with pytest.raises(AssertionError):
        test_zero3_a_parameter_a_module_uses_on_some_ranks_only_goes_as_zeros_before_the_next_gather()
    with pytest.raises(AssertionError):
        test_zero12_after_asking_the_fast_path_hands_over_the_zeros_that_follow_a_hook()


def test_a_planner_that_hands_over_unreached_parameters_without_zeros_fails_the_replays(monkeypatch):
    _mutate(monkeypatch, planning, ("(nxt, args_of[k], UNUSED)", "(nxt, args_of[k], FIRED)"),
            ("zeros.append((params[k], self.args[0][k], UNUSED))", "zeros.append((params[k], self.args[0][k], FIRED))"),
            ("(param, args_of[k], UNUSED)", "(param, args_of[k], FIRED)"))
    with pytest.raises(AssertionError):
        test_zero3_a_parameter_a_module_uses_on_some_ranks_only_goes_as_zeros_before_the_next_gather()
    with pytest.raises(AssertionError):
        test_zero12_a_parameter_some_rank_never_reaches_goes_as_zeros_in_its_turn()


def test_a_fast_path_that_hands_over_before_an_unreached_parameter_alone_fails_the_replays(monkeypatch):
    _mutate(monkeypatch, planning, ("steps[k] = (params[k], tuple(reversed(zeros)), after)",
                                    "steps[k] = (params[k], (), after)"))
    with pytest.raises(AssertionError):
        test_zero12_after_asking_the_fast_path_hands_over_the_zeros_that_follow_a_hook()


def test_a_planner_that_never_asks_what_a_backward_reaches_fails_the_replays(monkeypatch):
    """Taking every parameter as reached until the epilogue hands ``b`` over last, after ``a``'s hook."""
    _mutate(monkeypatch, planning, ("reached = walk.reached[0] = _asked(self.backend, walk.order.sequences[0], at)",
                                    "reached = [True] * len(walk.order.sequences[0])"),
            ("reached = walk.reached[sequence] = _asked(self.backend, params, k)", "pass"))
    with pytest.raises(AssertionError):
        test_zero12_a_backward_asks_what_it_reaches_only_at_a_hook_out_of_turn()


#: The fast path's zeros for a hook without a gradient (both stages).
_FAST_PATH_ZEROS = ("            if param.grad is None:\n                self._zero_fill(((param, WHY[FIRED]),))\n"
                    "            planner.stock_hook", "            planner.stock_hook")
#: Edits of the stage mixins' hooks (their in-order fast path) and, for each, a replay it turns red.
BROKEN_HOOKS = {
    "zero12, taken in a nested backward": (
        stage12_module, (" and _current_graph_task_id() == planner.wake_task", ""),
        lambda monkeypatch: test_zero12_reentrant_checkpointing_begun_late_stops_every_rank()),
    "zero12, not moving on": (
        stage12_module, ("            planner.step = planner.steps[step[2]]\n", ""),
        lambda monkeypatch: test_zero12_a_model_every_rank_uses_in_one_order_is_handed_over_as_each_hook_fires()),
    "zero12, without the zeros after it": (
        stage12_module, ("                self._carry_out(step[1])\n", "                pass\n"),
        lambda monkeypatch: test_zero12_after_asking_the_fast_path_hands_over_the_zeros_that_follow_a_hook()),
    "zero12, without zeros for a hook without a gradient": (
        stage12_module, _FAST_PATH_ZEROS,
        lambda monkeypatch: test_zero12_a_hook_without_a_gradient_goes_as_zeros_at_that_hook()),
    "zero3, before its due clock": (
        stage3_module, (" and clock.position >= step[1]", ""),
        lambda monkeypatch: test_zero3_a_gradient_that_arrives_before_a_gather_where_the_order_has_it_after((0, 1))),
    "zero3, at a hook that is not the last": (
        stage3_module, (' \\\n                and getattr(param, "ds_grad_is_ready", True)', ""),
        lambda monkeypatch: test_zero3_tiled_compute_keeps_each_parameters_last_hook_in_the_order()),
    "zero3, not moving on": (
        stage3_module, ("planner.step = following = planner.steps[step[2]]", "following = planner.steps[step[2]]"),
        lambda monkeypatch: test_zero3_hooks_in_other_orders_inside_each_module()),
    "zero3, the planner woken at every module": (
        stage3_module, ("            planner.wake_at = following[1]\n", ""),
        lambda monkeypatch: test_zero3_in_order_hooks_after_the_first_backward_go_by_the_fast_path(monkeypatch)),
    "zero3, without zeros for a hook without a gradient": (
        stage3_module, _FAST_PATH_ZEROS,
        lambda monkeypatch: test_zero3_a_hook_without_a_gradient_goes_as_zeros_at_that_hook()),
}


@pytest.mark.parametrize("broken", BROKEN_HOOKS)
def test_a_broken_fast_path_fails_the_replays(monkeypatch, broken):
    module, edit, replayed = BROKEN_HOOKS[broken]
    _mutate(monkeypatch, module, edit)
    with pytest.raises((AssertionError, Hang)):
        replayed(monkeypatch)
