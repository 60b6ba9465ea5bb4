"""The rank agreement as a pure state machine: what each rank hands DeepSpeed, and when (docs/rank_agreement.md).

No torch and no DeepSpeed here. The ZeRO mixins (``stage12``, ``stage3``) feed a :class:`Planner` the events of
a backward -- a gradient hook fired, the backward entered a module (ZeRO-3), the ranks left the module order, the
epilogue -- and carry out what it returns: the parameters to hand DeepSpeed now, in that order, each with why
(:data:`FIRED`, :data:`UNUSED`, :data:`HELD`). Autograd's "will this backward reach it" and the ranks
(``safe_zero.ranks.Ranks``) come in through an :class:`Optimizer`, so the replay tests
(``tests/fixes/test_gradless_planner.py``) drive several planners in one process with recorded per-rank events,
through the mixins' own hooks, and check that every rank hands over the same sequence.

Every method of a planner is called on every rank for the same events in the same order, except :meth:`hook`,
whose calls follow each rank's own autograd and need not match across ranks: that is the point.
"""

from __future__ import annotations

import enum
import heapq
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

from safe_zero.errors import RankDivergenceError

if TYPE_CHECKING:
    from safe_zero.ranks import Ranks

#: The due clock of a parameter no rank's agreeing backward reached: it is handed over at the epilogue.
AT_EPILOGUE = 2**62
#: ``Planner.wake_at`` while no module boundary can make anything due.
NEVER = 2**63

#: Why a parameter is handed over. FIRED: its hook fired on this rank (a ``None`` gradient there goes as zeros).
FIRED = 0
#: UNUSED: this rank's backward will not reach it; it goes as zeros in its turn.
UNUSED = 1
#: HELD: some rank's backward did not reach it in an agreed backward; every rank hands it over at the epilogue.
HELD = 2

#: ``(parameter, the hook arguments DeepSpeed registered for it, FIRED | UNUSED | HELD)``.
Handover = tuple[Any, tuple, int]


class Mode(enum.Enum):
    """What the planner does with the hooks, fixed when the optimizer is built."""

    #: One data-parallel rank: each hook goes to DeepSpeed as it fires.
    PASS_THROUGH = "pass-through"
    #: ``"find_unused_parameters": false``: DDP's default contract, every rank uses every parameter. Hooks pass
    #: through; the epilogue checks, locally, that every one fired (:meth:`Planner.unfired`).
    STRICT = "strict"
    #: The ranks agree on what each backward reaches, then walk one agreed order.
    AGREED = "agreed"


class WalkPhase(enum.Enum):
    """Where a :class:`Planner` in ``Mode.AGREED`` stands in agreeing on and walking a reduction order."""

    #: No agreed order: the next reducing backward agrees (the first one, or after the order was dropped).
    UNAGREED = "unagreed"
    #: An agreement of this backward is in flight or known; parameters some rank misses wait for the epilogue.
    AGREEING = "agreeing"
    #: An order is agreed and this backward has not begun to walk it.
    ORDERED = "ordered"
    #: This backward walks the agreed order.
    WALKING = "walking"
    #: ZeRO-3: every rank left the module order in this backward; the rest of the walk waits for the epilogue.
    HOLDING = "holding"


class Optimizer(Protocol):
    """What a planner needs from the ZeRO optimizer it plans for and from autograd (the mixins':
    ``gradients.OptimizerView``), and the ranks its agreement and order are made with."""

    #: The collectives (``safe_zero.ranks``).
    ranks: Ranks

    def agreed_groups(self) -> list[tuple[Any, list[Any]]]:
        """Per data-parallel group: the trainable parameters an agreement covers (``(group, params)``)."""

    def ordered_groups(self) -> list[tuple[Any, list[Any]]]:
        """Per data-parallel group: the trainable parameters an agreed order sequences."""

    def reached(self, params: Sequence[Any]) -> list[bool]:
        """Whether the running backward of this rank will reach each parameter's gradient accumulator (a new list,
        which the caller may change)."""

    def nested_backward(self) -> None:
        """A nested backward (reentrant checkpointing) ran inside this one: tell the user, once."""


class _At:
    """The parameter of the step after the last one of the order: the walk stands at ``k``, its end."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k


#: One step of the in-order fast path (``Planner.step``): ``(parameter, then, where the next step is in
#: Planner.steps)``; ``then`` is, on ZeRO-1/2, the hand-overs of the parameters after it this rank's backward does not
#: reach (zeros, in their turn), on ZeRO-3 the parameter's due clock.
Step = tuple[Any, Any, int]
#: ``Planner.step`` where the fast path is off: no parameter is its parameter.
NO_STEP: Step = (_At(-1), NEVER, -1)


class ReductionOrder:
    """The one order in which every rank hands DeepSpeed its trainable parameters, per data-parallel group.

    ``sequences[s][k]`` is the k-th parameter of group ``s``; ``args`` and ``due`` are aligned with it: the hook
    arguments DeepSpeed registered for it, and (ZeRO-3) the module clock at which it is due (:meth:`agree`).
    """

    def __init__(self, sequences: list[list[Any]], args: list[list[tuple]], due: list[list[int]] | None) -> None:
        self.sequences = sequences
        self.args = args
        self.due = due
        self.slot = {id(p): (s, k) for s, sequence in enumerate(sequences) for k, p in enumerate(sequence)}
        #: The steps built last, by ``reached``: taken as reaching every one (``None``; ZeRO-3: by due clock), and
        #: the last pattern asked (a backward that asks builds on the one it began with, so both are kept).
        self._steps: dict[bool, tuple[list[bool] | None, list[Step]]] = {}

    @classmethod
    def agree(cls, backend: Optimizer, arrived: list[Any], args: dict[int, tuple],
              clocks: dict[int, int] | None) -> ReductionOrder:
        """Every rank's hook order of the agreeing backward (this rank's: ``arrived``) and, on ZeRO-3, the module
        clock of each hook (``clocks``), one all-gather per group on every rank, merged into one order
        (:func:`merge_orders`) that keeps each rank's: a rank that uses what another did not still walks it in
        order. A parameter's due clock is the earliest at which a rank's hook fired for it (:data:`AT_EPILOGUE`
        where none did)."""
        sequences, args_rows, due_rows = [], [], []
        for group, params in backend.ordered_groups():
            if not params:
                continue
            n = len(params)
            index = {id(p): k for k, p in enumerate(params)}
            row = [-1] * (n if clocks is None else 2 * n)  # per parameter its place in this rank's hook order
            for place, k in enumerate(dict.fromkeys(index[id(p)] for p in arrived if id(p) in index)):
                row[k] = place
            if clocks is not None:  # then per parameter the clock of its first hook here
                row[n:] = [clocks.get(id(p), -1) for p in params]
            rows = backend.ranks.all_gather(group, row, bits=32)
            arrivals = [sorted((k for k in range(n) if r[k] >= 0), key=r.__getitem__) for r in rows]
            if clocks is None:
                merged = merge_orders(arrivals, n, key=lambda k: -k)
            else:
                due = [min((r[n + k] for r in rows if r[n + k] >= 0), default=AT_EPILOGUE) for k in range(n)]
                merged = merge_orders(arrivals, n, key=lambda k: (due[k], -k))
                due_rows.append([due[k] for k in merged])
            sequence = [params[k] for k in merged]
            sequences.append(sequence)
            args_rows.append([args[id(p)] for p in sequence])
        return cls(sequences, args_rows, due_rows if clocks is not None else None)

    def steps(self, reached: list[bool] | None) -> list[Step]:
        """One sequence: per position, the fast path's step there (``Planner.step``), then the end's. ZeRO-1/2,
        for a backward that reaches ``reached`` (aligned with the sequence; ``None``: taken to reach every one, as
        long as no hook comes out of turn): a step per parameter it reaches, with the zeros after it, pointing at the
        next one it reaches. ZeRO-3 (``due``, ``reached`` None): a step per parameter, with its due clock. Built
        once per distinct ``reached``, in one pass from the end."""
        cached = self._steps.get(reached is None)
        if cached is None or cached[0] is not reached and cached[0] != reached:
            params, n = self.sequences[0], len(self.sequences[0])
            # NO_STEP where this backward does not reach a parameter: no step of the chain points there.
            steps: list[Step] = [NO_STEP] * n + [(_At(n), NEVER if self.due is not None else (), n)]
            if self.due is not None:
                for k in range(n):
                    steps[k] = (params[k], self.due[0][k], k + 1)
            else:
                after, zeros = n, []
                for k in reversed(range(n)):
                    if reached is not None and not reached[k]:
                        zeros.append((params[k], self.args[0][k], UNUSED))
                        continue
                    steps[k] = (params[k], tuple(reversed(zeros)), after)
                    after, zeros = k, []
            cached = self._steps[reached is None] = (reached, steps)
        return cached[1]


def merge_orders(arrivals: list[list[int]], n: int, key: Callable[[int], Any]) -> list[int]:
    """``range(n)`` in one order in which each of ``arrivals`` (the ranks' hook orders, as indices) comes in its
    own order, where they do not contradict each other. Wherever the orders leave a choice (what one rank reached
    and the others did not, what none reached), the lowest ``key`` goes first: the highest parameter index, as a
    backward mostly runs last-registered first, so that what no rank reached yet has a likely place. Where the
    orders contradict each other (a cycle), the lowest ``key`` among what is left goes next. Deterministic: every
    rank computes it from the same gathered rows."""
    after: list[list[int]] = [[] for _ in range(n)]
    waiting = [0] * n  # per index: how many arrivals still have something before it
    for order in arrivals:
        for a, b in zip(order, order[1:]):
            after[a].append(b)
            waiting[b] += 1
    ready = [(key(k), k) for k in range(n) if not waiting[k]]
    heapq.heapify(ready)
    placed, merged = [False] * n, list[int]()
    while len(merged) < n:
        if ready:
            k = heapq.heappop(ready)[1]
            if placed[k]:
                continue
        else:  # the arrivals contradict each other
            k = min((k for k in range(n) if not placed[k]), key=key)
        placed[k] = True
        merged.append(k)
        for b in after[k]:
            waiting[b] -= 1
            if not waiting[b] and not placed[b]:
                heapq.heappush(ready, (key(b), b))
    return merged


class _Agreement:
    """One backward's agreement on which parameters some rank does not reach: all-reduces in flight, then a set."""

    def __init__(self, task: int, backend: Optimizer) -> None:
        self.task = task
        self.queued: list[tuple[Any, tuple]] = []  # hooks that fired before the answer landed, in arrival order
        self.arrived: list[Any] = []  # every reducing hook's parameter, in the order they fired
        self.clocks: dict[int, int] = {}  # ZeRO-3: per parameter, the module clock at its first hook
        self.held: set[int] | None = None
        self._pending = [(params, backend.ranks.all_reduce_min(group, backend.reached(params)))
                         for group, params in backend.agreed_groups() if params]

    def known(self, wait: bool) -> bool:
        """Whether the answer is in (``wait``: wait for it)."""
        if self.held is None:
            if not wait and not all(flight.done() for _, flight in self._pending):
                return False
            held: set[int] = set()
            for params, flight in self._pending:
                held.update(id(p) for p, everywhere in zip(params, flight.result()) if not everywhere)
            self.held, self._pending = held, []
        return True

    def hook(self, param: Any, args: tuple, clock: int | None, wait: bool) -> list[Handover]:
        """Queue until the answer is known (``wait``: wait for it), then hand over what every rank reached."""
        self.arrived.append(param)
        if clock is not None:
            self.clocks.setdefault(id(param), clock)
        if not self.known(wait):
            self.queued.append((param, args))
            return []
        handovers = self.drain()
        if id(param) not in self.held:  # type: ignore[operator]  # drain() asserted it known
            handovers.append((param, args, FIRED))
        return handovers

    def drain(self) -> list[Handover]:
        queued, self.queued = self.queued, []
        held = self.held
        assert held is not None, "drained before the answer is known"
        return [(p, args, FIRED) for p, args in queued if id(p) not in held]


def _asked(backend: Optimizer, sequence: list[Any], k: int) -> list[bool]:
    """Whether this rank's backward reaches each parameter of an order's ``sequence``, the first ``k`` (handed over
    already) taken as reached. Asked about the whole sequence, the same list in every backward, which the backend
    may key what it keeps on."""
    reached = backend.reached(sequence)
    reached[:k] = [True] * k
    return reached


class _Walk:
    """One backward's progress along a ``ReductionOrder``."""

    def __init__(self, order: ReductionOrder, task: int, backend: Optimizer, clocked: bool) -> None:
        self.order = order
        self.task = task
        self.backend = backend
        self.clocked = clocked
        self.next = [0] * len(order.sequences)  # per sequence: the first parameter not yet handed over
        self.fired: dict[int, tuple] = {}  # parameters whose hook fired, waiting for the ones before them
        # ZeRO-1/2: asked at most once per backward, at its first hook out of turn (Planner.hook)
        self.reached: list[list[bool] | None] = [None] * len(order.sequences)
        self.asked: dict[int, bool] = {}  # ZeRO-3: asked one by one, at module boundaries

    def hand_over(self, sequence: int, finish: bool = False, clock: int | None = None,
                  ask: bool = True) -> list[Handover]:
        """The parameters of ``sequence`` from its first one not yet handed over, while each is ready: fired, or
        not reached by this rank's backward (at the epilogue: every one left; ``ask=False``: only fired), and due
        by ``clock``.

        One reached whose hook has not fired yet stops the walk until it fires. On ZeRO-3 that can be past a
        module's gathers where the agreed order has it before them: the ranks then still reduce in one order if
        its gradient moved on every rank alike, and as stock does (each bucket sorted by parameter) if not.
        """
        order = self.order
        params, args_of, k = order.sequences[sequence], order.args[sequence], self.next[sequence]
        due, now = (order.due[sequence], clock) if clock is not None and order.due is not None else (None, 0)
        fired = self.fired
        handovers = []
        while k < len(params):
            if due is not None and due[k] > now:
                break
            param = params[k]
            args = fired.pop(id(param), None)
            if args is not None:
                handovers.append((param, args, FIRED))
            elif finish or (ask and not self.reaches(sequence, k)):
                handovers.append((param, args_of[k], UNUSED))
            else:
                break
            k += 1
        self.next[sequence] = k
        return handovers

    def reaches(self, sequence: int, k: int) -> bool:
        """ZeRO-3: whether this rank's backward reaches the ``k``-th parameter of ``sequence``, asked once per
        parameter and backward, at the module boundary where it is due (ZeRO-1/2 asks in :meth:`Planner.hook`)."""
        params = self.order.sequences[sequence]
        key = id(params[k])
        if key not in self.asked:
            self.asked[key] = self.backend.reached([params[k]])[0]
        return self.asked[key]

    def wake_at(self) -> int:
        """The clock at which a module boundary can hand over the next parameter of the first sequence."""
        if not self.order.due:
            return -1
        due, k = self.order.due[0], self.next[0]
        return due[k] if k < len(due) else NEVER


class Planner:
    """Agreement, agreed order and walk of one optimizer, with an explicit :class:`WalkPhase`.

    ``clocked``: ZeRO-3, where hooks and module boundaries carry the module clock and the order records it.
    ``queues``: the bucket reductions are a backward's only collectives (ZeRO-1/2), so hooks may queue while
    the agreement is in flight; on ZeRO-3, which also gathers during backward, a hook waits for it instead.

    ``wake_at`` and ``wake_task`` tell a module boundary whether it can change anything: a ZeRO-3 coordinator
    calls :meth:`boundary` only at a clock ``>= wake_at`` or in another autograd task than ``wake_task``, the
    autograd task of the walk (-1 outside one); on ZeRO-1/2 the fast path (``step``) is taken in that task only.
    """

    def __init__(self, mode: Mode, backend: Optimizer, *, clocked: bool = False, queues: bool = False) -> None:
        self.mode = mode
        #: Whether the hooks go through :meth:`hook` (several ranks), read per hook.
        self.routes = mode is not Mode.PASS_THROUGH
        self.backend = backend
        self.clocked = clocked
        self.queues = queues
        self.phase = WalkPhase.UNAGREED
        self.order: ReductionOrder | None = None
        #: A backward ran nested autograd tasks (reentrant checkpointing): the outer graph does not show what it
        #: reaches, so every backward agrees from then on.
        self.nested = False
        self.wake_at = -1
        self.wake_task = -1
        self._agreement: _Agreement | None = None
        self._walk: _Walk | None = None
        self._fired: set[int] | None = None  # Mode.STRICT: the parameters whose hook fired in this backward
        self._settling: tuple[_Agreement, dict[int, tuple]] | None = None
        #: The in-order fast path (one sequence, while a backward walks the agreed order; :meth:`_expect_next` says
        #: where): ``(parameter, then, after)``, the next parameter of the order (ZeRO-1/2: the next one this rank's
        #: backward reaches, as far as it has asked autograd). When its hook fires (ZeRO-1/2: in the autograd task
        #: ``wake_task``, so that a nested backward's hook stops at :meth:`hook`; ZeRO-3: a last one, at a clock
        #: ``>= then``, its due), the caller
        #: may hand it over itself, as ``FIRED`` with its own hook arguments, instead of calling :meth:`hook`, and
        #: must then move ``step`` on to ``steps[after]`` and hand over ``then`` (ZeRO-1/2; ZeRO-3: set ``wake_at``
        #: to the new step's due), as the stage mixins' hooks do; any other hook goes to :meth:`hook`. An identity test
        #: and a list index per hook, where a call costs microseconds between autograd's kernels (issue 26).
        self.step: Step = NO_STEP
        self.steps: list[Step] = []

    def begin_backward(self) -> None:
        """A new backward (not a nested one): forget what one that never reached its epilogue left."""
        self._agreement = self._walk = self._fired = None
        self.step = NO_STEP
        self._set_phase(WalkPhase.ORDERED if self.order is not None else WalkPhase.UNAGREED)

    # Over the complexity limit on purpose: the walk's hand-over is inlined here, the one call per gradient hook
    # (issue 26: at most a couple of safe_zero calls per tensor per step); _Walk.hand_over is ZeRO-3's rule, uninlined.
    def hook(  # noqa: C901
            self, param: Any, args: tuple, task: int, clock: int | None = None, final: bool = True) -> list[Handover]:
        """``param``'s gradient hook fired in autograd task ``task`` (at module clock ``clock`` on ZeRO-3):
        what to hand DeepSpeed now, in order. ``final=False``: one of several hooks of a parameter in one
        backward (ZeRO-3 tiled compute), of which DeepSpeed buckets only the last.

        Raises ``RankDivergenceError`` where a nested backward begins while an agreed order is walked."""
        if self.mode is not Mode.AGREED:
            if self.mode is Mode.STRICT:
                if self._fired is None:
                    self._fired = set()
                self._fired.add(id(param))
            return [(param, args, FIRED)]
        phase = self.phase
        if phase is WalkPhase.UNAGREED or phase is WalkPhase.AGREEING:
            return self._agreement_of(task).hook(param, args, clock, wait=not self.queues)
        if not final:
            return [(param, args, FIRED)]
        walk = self._walk if self._walk is not None and self._walk.task == task else self._walk_of(task)
        slot = walk.order.slot.get(id(param))
        if slot is None:  # made trainable after the order was agreed: nothing to keep in step with
            return [(param, args, FIRED)]
        sequence, position = slot
        fired = walk.fired
        if self.step is not NO_STEP:
            at = self._fast_path_at(walk)
            if clock is None and position > at and id(self.step[0]) not in fired:
                # ZeRO-1/2, ahead of its turn while the one expected has not fired. The first such hook of a backward
                # asks autograd what this backward reaches (in its own task: a nested one stopped above).
                reached = walk.reached[0]
                if reached is None:
                    reached = walk.reached[0] = _asked(self.backend, walk.order.sequences[0], at)
                if reached[at]:
                    # The one expected comes later: parked, and the fast path stays on, now skipping what this
                    # backward does not reach.
                    fired[id(param)] = args
                    self.steps = walk.order.steps(reached)
                    self.step = self.steps[at]
                    return []
            walk.next[0], self.step = at, NO_STEP
        if self.phase is WalkPhase.HOLDING:
            fired[id(param)] = args
            return []
        # The walk's hand-over (``_Walk.hand_over``), inlined: it runs per parameter per step.
        # On ZeRO-3 (a clock) a parameter whose hook will not fire waits for the next module boundary: asking
        # autograd at every hook costs more than the wait. ZeRO-1/2 asks at the first hook of a backward that comes
        # out of turn (above, or here once the fast path is off): a backward that reaches every parameter in the
        # agreed order asks nothing.
        order = walk.order
        params, args_of, k = order.sequences[sequence], order.args[sequence], walk.next[sequence]
        due, now = (order.due[sequence], clock) if clock is not None and order.due is not None else (None, 0)
        reached = walk.reached[sequence]
        if position == k and (due is None or due[k] <= now):  # the next one due, as it is when ranks agree
            handovers = [(param, args, FIRED)]
            k += 1
        else:  # parked until the ones before it are handed over
            fired[id(param)] = args
            handovers = []
            if reached is None and clock is None:  # ZeRO-1/2, out of turn: ask (see above)
                reached = walk.reached[sequence] = _asked(self.backend, params, k)
        while k < len(params):
            if due is not None and due[k] > now:
                break
            nxt = params[k]
            nxt_args = fired.pop(id(nxt), None) if fired else None
            if nxt_args is not None:
                handovers.append((nxt, nxt_args, FIRED))
            elif clock is not None:
                break
            elif reached is None or reached[k]:  # reached, or taken as reached until a hook comes out of turn
                break
            else:
                handovers.append((nxt, args_of[k], UNUSED))
            k += 1
        walk.next[sequence] = k
        if due is not None and sequence == 0:
            self.wake_at = due[k] if k < len(due) else NEVER
        self._expect_next(walk, reached)
        return handovers

    def _expect_next(self, walk: _Walk, reached: list[bool] | None) -> None:
        """Offer the fast path (``step``) where the walk now stands, if it can be taken there.

        On ZeRO-1/2 also while parameters are parked (fired ahead of their turn, as where a rank uses what no rank
        used in the agreeing backward): the fast path then stops at the first of them, which goes at the next hook
        that is not expected, or at the epilogue -- later, in the same order, which is all the buckets need there.
        ZeRO-3 hands over between module gathers at the clock the order says, so there the fast path waits until
        nothing is parked."""
        order, k = walk.order, walk.next[0]
        if len(order.sequences) != 1 or k >= len(order.sequences[0]) or walk.fired and order.due is not None:
            return
        if order.due is None and reached is not None and not reached[k]:
            return
        self.steps = order.steps(None if order.due is not None else reached)
        self.step = self.steps[k]

    def _fast_path_at(self, walk: _Walk) -> int:
        """Where the fast path left the walk: every parameter before its step's is handed over."""
        expected = self.step[0]
        return expected.k if type(expected) is _At else walk.order.slot[id(expected)][1]

    def _caught_up(self, walk: _Walk) -> None:
        walk.next[0], self.step = self._fast_path_at(walk), NO_STEP

    def boundary(self, clock: int, task: int) -> list[Handover]:
        """ZeRO-3: the backward (task ``task``) enters a module, ``clock`` modules after its forward began, and
        its gathers follow. Every rank is at the same point here: start this backward's agreement (before its
        first gather), or hand over every parameter due by ``clock``.

        Raises ``RankDivergenceError`` where a nested backward begins while an agreed order is walked."""
        if self.phase is WalkPhase.UNAGREED or self.phase is WalkPhase.AGREEING:
            self._agreement_of(task)
            return []
        walk = self._walk_of(task)
        if self.phase is WalkPhase.HOLDING:
            return []
        if self.step is not NO_STEP:
            self._caught_up(walk)
        handovers = walk.hand_over(0, clock=clock)
        self.wake_at = walk.wake_at()
        self._expect_next(walk, None)
        return handovers

    def left_order(self) -> None:
        """ZeRO-3: every rank left the recorded module order at the same module, so the due clocks no longer hold:
        the rest of a backward in progress goes at its epilogue, and the next backward agrees again."""
        self.order = None
        if self._walk is not None:
            if self.step is not NO_STEP:
                self._caught_up(self._walk)
            self._set_phase(WalkPhase.HOLDING)
        elif self.phase is WalkPhase.ORDERED:
            self._set_phase(WalkPhase.UNAGREED)

    def unfired(self, expected: Iterable[Any]) -> list[Any]:
        """``Mode.STRICT``, at the epilogue: the ``expected`` parameters whose hook did not fire in this backward
        (none where no reducing hook ran at all: accumulation without reduction)."""
        fired, self._fired = self._fired, None
        return [] if fired is None else [p for p in expected if id(p) not in fired]

    def finish_backward(self, params_in_order: Iterable[tuple[Any, tuple]]) -> list[Handover]:
        """The epilogue: what is left to hand over, in order. ``params_in_order``: every parameter with its hook
        arguments, in parameter order (the order held parameters go in). Then call :meth:`settle_order`."""
        walk, self._walk = self._walk, None
        if walk is not None:
            if self.step is not NO_STEP:
                self._caught_up(walk)
            handovers = []
            for sequence in range(len(walk.order.sequences)):
                handovers += walk.hand_over(sequence, finish=True)
            self._set_phase(WalkPhase.ORDERED if self.order is not None else WalkPhase.UNAGREED)
            return handovers
        agreement, self._agreement = self._agreement, None
        if agreement is None:
            return []
        params_in_order = list(params_in_order)
        agreement.known(wait=True)
        handovers = agreement.drain()
        held = agreement.held
        assert held is not None  # known(wait=True) set it
        handovers += [(p, args, HELD) for p, args in params_in_order if id(p) in held]
        self._settling = (agreement, {id(p): args for p, args in params_in_order})
        self._set_phase(WalkPhase.UNAGREED)
        return handovers

    def settle_order(self, walkable: bool) -> None:
        """After the epilogue's hand-overs: where this backward agreed and its order can be walked (``walkable``;
        ZeRO-3: the module order is recorded), merge every rank's order, one all-gather per group."""
        settling, self._settling = self._settling, None
        if settling is not None and walkable and not self.nested:
            agreement, args = settling
            self.order = ReductionOrder.agree(self.backend, agreement.arrived, args,
                                              agreement.clocks if self.clocked else None)
            self._set_phase(WalkPhase.ORDERED)

    def _set_phase(self, phase: WalkPhase) -> None:
        self.phase = phase
        if phase is WalkPhase.HOLDING:
            self.wake_at = NEVER
        elif phase is not WalkPhase.WALKING:
            self.wake_at, self.wake_task = -1, -1

    def _agreement_of(self, task: int) -> _Agreement:
        """This backward's agreement, started at its first reducing hook or module boundary and ended at its
        epilogue. With reentrant checkpointing a block's gradients arrive in a nested backward (another task) of
        the same ``engine.backward``; the agreement spans it, holding them for the epilogue."""
        agreement = self._agreement
        if agreement is None:
            agreement = self._agreement = _Agreement(task, self.backend)
            self._set_phase(WalkPhase.AGREEING)
        elif agreement.task != task:
            self._nested_seen()
        return agreement

    def _walk_of(self, task: int) -> _Walk:
        """This backward's walk along the agreed order, begun at its first hook or module boundary.

        Raises ``RankDivergenceError`` in a nested backward: it reaches parameters the outer graph did not show,
        some of which may already have gone as zeros. Every rank runs the same checkpointed blocks, so every rank
        stops here, before the update; the next backwards agree again instead of walking."""
        walk = self._walk
        if walk is None:
            assert self.order is not None, "a walk needs an agreed order"
            walk = self._walk = _Walk(self.order, task, self.backend, self.clocked)
            self._set_phase(WalkPhase.WALKING)
            self.wake_at, self.wake_task = walk.wake_at(), task
        elif walk.task != task:
            self._nested_seen()
            raise RankDivergenceError(
                "a nested backward (reentrant activation checkpointing, use_reentrant=True) began after the first "
                "step: its gradients may already have been reduced as zeros, so this step's update would be wrong. "
                "Enable reentrant checkpointing before the first step (safe_zero then reduces such gradients at the "
                "end of each backward), or use non-reentrant checkpointing (use_reentrant=False, e.g. "
                'gradient_checkpointing_kwargs={"use_reentrant": False}).')
        return walk

    def _nested_seen(self) -> None:
        # From the next backward on, agree again: the outer graph no longer shows what a rank reaches.
        self.nested, self.order = True, None
        self.backend.nested_backward()

