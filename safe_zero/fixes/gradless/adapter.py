"""What the ZeRO-1/2 and ZeRO-3 optimizer mixins share: they feed a :class:`Planner` the events of each backward
and carry out the hand-overs it returns (docs/rank_agreement.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch._C import _current_graph_task_id

from safe_zero.errors import UnusedParameterError
from safe_zero.fixes.gradless import FIX
from safe_zero.fixes.gradless.gradients import OptimizerView
from safe_zero.fixes.gradless.planner import FIRED, HELD, UNUSED, Handover, Mode, Optimizer, Planner
from safe_zero.patching import overrides
from safe_zero.session import State, session_for, state_of

if TYPE_CHECKING:
    # mypy reads each mixin as the DeepSpeed class it is put before (untyped: its attributes are Any); at run time a
    # mixin subclasses nothing (docs/developing.md, "A new fix").
    from deepspeed.runtime.base_optimizer import ZeROOptimizer as _ZeROOptimizer

    from safe_zero.fixes.gradless.order import ModuleClock
else:
    _ZeROOptimizer = object

WHY_NOT_USED = "was not used on this rank"
#: What a zero gradient stands for, indexed by why the planner hands the parameter over (the report's wording).
WHY = {FIRED: "had no gradient", UNUSED: WHY_NOT_USED, HELD: WHY_NOT_USED}


class Gradless(Planner):
    """The fix's part of a ZeRO optimizer's :class:`~safe_zero.session.State` (``optimizer._safe_zero.gradless``;
    ``None`` where the fix is off): its planner, and beside it what its hooks hand over to. On ZeRO-3 it follows the
    coordinator's module clock (``order.Follower``).

    A planner itself rather than a holder of one: the hooks run per parameter per step, and from the planner they
    reach the hook body and the clock in one attribute each (one hop more per hook than attributes of the optimizer).
    """

    def __init__(self, mode: Mode, backend: Optimizer, *, queues: bool, optimizer: PlannerAdapter,
                 clock: ModuleClock | None = None) -> None:
        super().__init__(mode, backend, clocked=clock is not None, queues=queues)
        #: The optimizer whose hooks this planner routes, and DeepSpeed's hook body, bound once: no ``super()`` per
        #: hook.
        self.optimizer = optimizer
        self.stock_hook = optimizer._stock_hook()
        #: ZeRO-3: the module clock of safe_zero's coordinator, which the walk follows (``None``: ZeRO-1/2, or a
        #: stock coordinator, and then no walk on a clock).
        self.clock = clock
        #: Whether the session was told that held parameters went at the epilogue (once per optimizer).
        self.held_reported = False
        #: ``id()`` of each parameter whose zero gradient the session was told of (once per parameter).
        self.zeroed: set[int] = set()

    def at_module(self, position: int, task: int) -> None:
        """The clock's follower: the backward enters a module where this planner may hand over (before its gathers)."""
        optimizer = self.optimizer
        if not getattr(optimizer, "_coalesce_grad_reduction", False):
            optimizer._carry_out(self.boundary(position, task))


class PlannerAdapter(_ZeROOptimizer):
    """Base of ``ReduceInOneOrderStage12`` and ``ReduceInOneOrderStage3``.

    A stage mixin builds its planner once, at construction (:meth:`_start_planner`), and from then on tells it
    of every backward's start, every reducing hook and the epilogue. Its hook override calls DeepSpeed's own hook
    body for what the planner returns (``_carry_out``), with a zero gradient where the parameter has none.
    """

    _safe_zero: State

    def _start_planner(self, world: int, queues: bool, clock: ModuleClock | None = None) -> None:
        """Route the hooks through a planner where the fix is on (else every override passes through); ZeRO-3 gives
        the module clock its walk follows."""
        session = session_for(self)
        if not session.uses(FIX):
            return
        mode = (Mode.PASS_THROUGH if world < 2 else
                Mode.AGREED if session.options.find_unused_parameters else Mode.STRICT)
        backend = OptimizerView(self, session, hold_accumulators=clock is None)
        self._plan(Gradless(mode, backend, queues=queues, optimizer=self, clock=clock))

    def _plan(self, planner: Gradless) -> None:
        """Route the hooks through ``planner`` from now on; where it agrees on a clock, its walk follows the clock's
        module entries (``Gradless.at_module``). The replays (``tests/fixes/test_gradless_planner.py``) give their own
        planners here."""
        state_of(self).gradless = planner
        if planner.clock is not None and planner.mode is Mode.AGREED:
            planner.clock.follow(planner)

    # -- what each stage provides --------------------------------------------------------------------------------

    def _reduced_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        """Per data-parallel group, the trainable parameters whose hooks the planner sees."""
        raise NotImplementedError

    def _ordered_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        """Per data-parallel group, the parameters an agreed order sequences."""
        return self._reduced_params_by_group()

    def _trainable_params(self) -> Iterable[torch.nn.Parameter]:
        raise NotImplementedError

    def _zero_fill(self, wanted: Iterable[tuple[torch.nn.Parameter, str]]) -> None:
        """A zero gradient for each ``(param, why)`` of ``wanted`` (``why``: the report's wording)."""
        raise NotImplementedError

    def _stock_hook(self) -> Callable[..., None]:
        """DeepSpeed's hook body, bound: called with a parameter and its hook arguments."""
        raise NotImplementedError

    def _walkable(self) -> bool:
        """Whether an order agreed at this epilogue can be walked in the next backwards."""
        return True

    # -- the events ------------------------------------------------------------------------------------------------

    @overrides
    def enter_backward(self) -> None:
        # engine.backward enters here before autograd runs: what a backward that never reached its epilogue (an
        # exception) left must not decide this one. Reentrant phases re-enter from inside a hook.
        planner = self._safe_zero.gradless
        if planner is not None and _current_graph_task_id() == -1:
            planner.begin_backward()
        super().enter_backward()

    @overrides
    def backward_epilogue(self, *args: Any, **kwargs: Any) -> None:
        # Inside DeepSpeed's coalesce_grad_reduction the hooks only accumulate, and the flush at the block's exit
        # reduces the parameters that have a gradient on this rank, in parameter order (0.19.8 engine.py:3300-3336,
        # _flush_coalesced_reduction_zero12/_zero3): a parameter only some ranks used would shift every later one in
        # the buckets. A zero gradient on every other parameter makes every rank's flush reduce the same ones; no
        # collective is needed, so this holds with "find_unused_parameters": false too.
        planner = self._safe_zero.gradless
        if planner is not None and planner.routes \
                and getattr(self, "_coalesce_grad_reduction", False):
            self._zero_fill((param, WHY_NOT_USED) for param in self._trainable_params() if param.grad is None)
        super().backward_epilogue(*args, **kwargs)

    def _finish_backward(self, params_in_order: Iterable[tuple[torch.nn.Parameter, tuple]]) -> None:
        """At the epilogue, before DeepSpeed's: check the strict contract, or hand over what the planner held back
        (``params_in_order``: every parameter with its hook arguments, in parameter order), then let it settle the
        order for the next backwards.

        Raises ``UnusedParameterError`` (``"find_unused_parameters": false``) naming the trainable parameters whose
        hook did not fire on this rank; no collective, so only that rank raises."""
        planner: Gradless | None = self._safe_zero.gradless
        if planner is None:
            return
        if planner.mode is Mode.STRICT:
            # DDP's default contract, checked on this rank before the optimizer step can apply a wrong update.
            missed = planner.unfired(p for _, group in self._reduced_params_by_group() for p in group)
            if missed:
                raise UnusedParameterError(self._unused_message(missed))
            return
        handovers = planner.finish_backward(params_in_order)
        if not planner.held_reported and any(h[2] == HELD for h in handovers):
            planner.held_reported = True
            session_for(self).engaged(FIX, "parameters some ranks did not use were reduced in parameter order "
                                           "with zero gradients from those ranks")
        self._carry_out(handovers)
        planner.settle_order(self._walkable())

    def _carry_out(self, handovers: Iterable[Handover]) -> None:
        """DeepSpeed's hook body for each of ``handovers``, in order, with zeros where the parameter has no
        gradient (filled for all of them first: one zeroed buffer, not one per parameter)."""
        handovers = list(handovers)
        missing = [(param, WHY[reason]) for param, _, reason in handovers if param.grad is None]
        if missing:
            self._zero_fill(missing)
        planner = self._safe_zero.gradless
        assert planner is not None  # handovers come from it
        stock = planner.stock_hook
        for param, args, _ in handovers:
            stock(param, *args)

    def _unused_message(self, missed: list[torch.nn.Parameter]) -> str:
        names = getattr(self, "param_names", {}) or {}
        shown = [names.get(p, f"parameter of shape {tuple(getattr(p, 'ds_shape', p.shape))}") for p in missed[:5]]
        return (f"{len(missed)} trainable parameter(s) got no gradient in this backward on this rank ({shown}), but "
                '"safe_zero": {"find_unused_parameters": false} promises that every rank uses every parameter, so '
                "the ranks' gradient buckets no longer match. Remove that setting (the default, true, lets the ranks "
                "agree on what each used, like DDP's find_unused_parameters=True), or freeze the parameters that are "
                "never used.")
