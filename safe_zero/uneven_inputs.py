"""Uneven inputs: the engine ``safe_zero.initialize`` returns is a ``torch.distributed.algorithms.Joinable``.

Ranks that run different numbers of batches (a dataset that does not divide by the world size, RL rollouts filtered
per rank, packing) make stock DeepSpeed hang on NCCL, or abort on gloo, at the first collective a finished rank does
not join. Under ``with Join([engine]):`` (torch's context manager, as for DDP) a rank that ran out of batches shadows
each iteration the others still run: the same collectives, with a zero gradient.

- ZeRO-0/1/2: a backward of ``0 * p`` for every trainable parameter hands each gradient hook a zero gradient (the
  rank agreement walks them in the agreed order, so the reductions are the others'), then ``engine.step()`` (its
  gradient-norm reduction, the optimizer step and the all-gather of the updated partitions). No forward runs.
- ZeRO-3: the rank's last micro-batch runs again through the engine and its loss times zero goes backward, then
  ``engine.step()``: the same recorded module order, so the same parameter gathers and releases as the others'.
  Its forward's compute is spent again (a finished rank has nothing else to do); buffers a forward updates in
  training mode (BatchNorm's running statistics) see that batch again.

Without ``Join``, a rank that leaves training while another went on (a checkpoint save, ``destroy``) raises
:class:`UnevenInputsError` instead of hanging: each rank posts the micro-steps it begins to the process group's
store (:mod:`safe_zero.rank_progress`, which says what it sees and what not).

The update is DDP's under ``Join``: with ``divide_by_initial_world_size=True`` (the default) the gradient is the sum
over the ranks that had a batch divided by the world size; with ``False``, divided by the number of those ranks
(their loss is scaled by world size / ranks with a batch, which the iteration's ``Join`` all-reduce counts). The
gradient accumulation boundaries stay the same on every rank: a shadowed iteration is one micro-step.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as torch_dist
from deepspeed.constants import default_pg_timeout
from deepspeed.runtime.engine import DeepSpeedEngine
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from safe_zero.patching import calls, overrides
from safe_zero.rank_progress import RankProgress, UnevenInputsError
from safe_zero.ranks import default_store
from safe_zero.session import Session, State, state_of

if TYPE_CHECKING:
    # mypy reads the mixin as the engine it is put before; at run time it subclasses nothing (docs/developing.md).
    from deepspeed.runtime.engine import DeepSpeedEngine as _Engine
else:
    _Engine = object


class UnevenInputs:
    """The engine's part of :class:`~safe_zero.session.State` (``engine._safe_zero.uneven``)."""

    __slots__ = ("last_batch", "shadowing", "loss_scale", "divide_by_initial_world_size", "progress", "meeting")

    def __init__(self) -> None:
        #: The last micro-batch's ``(inputs, kwargs)`` inside a ``Join`` at ZeRO-3: what a finished rank runs again
        #: (kept after the Join, so a rank with no batch in a later one, an RL phase filtered to nothing, can too).
        self.last_batch: tuple[tuple, dict] | None = None
        #: A shadowed iteration runs: its forward is not an iteration of its own.
        self.shadowing = False
        #: This iteration's loss factor (``divide_by_initial_world_size=False``: world size / ranks with a batch).
        self.loss_scale = 1.0
        #: The ``Join`` keyword of the same name.
        self.divide_by_initial_world_size = True
        #: The micro-steps this rank begins and its meetings, in the store (``None``: one rank, or no store).
        self.progress: RankProgress | None = None
        #: Inside a meeting (a save that calls another): the inner one adds nothing.
        self.meeting = False


@calls("zero_optimization_partition_weights", "gradient_accumulation_steps", "step")
class JoinsUnevenInputs(_Engine):
    """Mixin for DeepSpeed's engine: a ``Joinable`` whose finished ranks shadow the others' iterations (see the
    module's docstring). Outside a ``Join`` it adds no collective (``Join.notify_join_context`` returns at once), only
    each micro-step's post to the store, and the meeting at saves (:mod:`safe_zero.rank_progress`).
    (Registered as a ``Joinable`` rather than derived from it, whose abstract ``__init__`` would shadow the engine's.)
    """

    _safe_zero: State

    @overrides
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        uneven = self._safe_zero.uneven
        assert uneven is not None  # make_joinable gave it
        if not uneven.shadowing and torch.is_grad_enabled():  # a training iteration (an evaluation is none, as DDP's)
            if uneven.progress is not None and self.module.training and self.zero_optimization_partition_weights():
                uneven.progress.begin(self.micro_steps)  # ZeRO-3's forward gathers: the micro-step's collectives begin
            # Every iteration tells the ranks that joined that this one has not (an all-reduce, inside a Join only).
            work = Join.notify_join_context(self)
            uneven.loss_scale = 1.0
            if work is not None:
                if not uneven.divide_by_initial_world_size:
                    work.wait()
                    uneven.loss_scale = self.dp_world_size / work.result()[0].item()
                if self.zero_optimization_partition_weights():
                    uneven.last_batch = (inputs, kwargs)
        return super().forward(*inputs, **kwargs)

    @overrides
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        uneven = self._safe_zero.uneven
        assert uneven is not None
        if uneven.progress is not None and not uneven.shadowing:
            uneven.progress.begin(self.micro_steps)
        scale = uneven.loss_scale
        return super().backward(loss * scale if scale != 1.0 else loss, *args, **kwargs)

    @overrides
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with _meeting(self, "save_checkpoint"):
            return super().save_checkpoint(*args, **kwargs)

    @overrides
    def _zero3_consolidated_16bit_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with _meeting(self, "the ZeRO-3 16-bit state dict (save_16bit_model, Accelerate's get_state_dict)"):
            return super()._zero3_consolidated_16bit_state_dict(*args, **kwargs)

    @overrides
    def destroy(self) -> None:
        uneven = self._safe_zero.uneven
        assert uneven is not None
        if uneven.progress is not None:
            uneven.progress.leave(self.micro_steps, "the engine's destroy")
        super().destroy()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        uneven = self._safe_zero.uneven
        assert uneven is not None
        uneven.divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return ShadowsAnIteration(self)

    @property
    def join_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def join_process_group(self) -> Any:
        return self.data_parallel_group


Joinable.register(JoinsUnevenInputs)


class ShadowsAnIteration(JoinHook):
    """What a rank that ran out of batches runs for each iteration another rank still runs."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def main_hook(self) -> None:
        engine, uneven = self.engine, self.engine._safe_zero.uneven
        uneven.shadowing, uneven.loss_scale = True, 1.0
        try:
            engine.backward(self._zero_loss())
            engine.step()
        finally:
            uneven.shadowing = False

    def post_hook(self, is_last_joiner: bool) -> None:
        # torch's Join leaves its configuration on the joinable: after it, a forward joins nothing.
        self.engine._join_config = _JoinConfig.construct_disabled_join_config()

    def _zero_loss(self) -> torch.Tensor:
        engine = self.engine
        if not engine.zero_optimization_partition_weights():
            return sum((p * 0).sum() for p in engine.module.parameters() if p.requires_grad)
        last = engine._safe_zero.uneven.last_batch
        if last is None:
            raise UnevenInputsError(
                "under ZeRO-3 a rank that runs out of batches inside Join runs its last micro-batch again, with a zero "
                "loss, to make the others' parameter gathers: this rank ran none inside this Join or an earlier one. "
                "Give every rank at least one batch inside its first Join (e.g. open it before the first step).")
        inputs, kwargs = last
        return _loss_of(engine(*inputs, **kwargs)) * 0


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a forward's output carries (``.loss``, a scalar), else the sum of its floating-point tensors."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.sum()
    values = output.values() if isinstance(output, dict) else output
    # sum() starts at 0: an int only where the output holds no floating-point tensor (then there is nothing to train)
    return sum(v.sum() for v in values if isinstance(v, torch.Tensor) and v.is_floating_point())  # type: ignore[return-value]


@contextlib.contextmanager
def _meeting(engine: Any, where: str) -> Iterator[None]:
    """Every rank meets at ``where`` before the save runs (:meth:`RankProgress.meet`); once, for nested saves."""
    uneven = engine._safe_zero.uneven
    if uneven.progress is None or uneven.meeting:
        yield
        return
    uneven.progress.meet(engine.micro_steps, where)
    uneven.meeting = True
    try:
        yield
    finally:
        uneven.meeting = False


def _progress_of(engine: Any, session: Session) -> RankProgress | None:
    """The engine's :class:`RankProgress` on the default store, under the engine's keys (``session.ranks``); ``None``
    with one rank or no store."""
    store = default_store()
    if store is None:
        return None
    group = engine.data_parallel_group or torch_dist.group.WORLD
    if torch_dist.get_world_size(group) < 2:
        return None
    prefix = f"{session.ranks.prefix(group)}/progress"
    return RankProgress(store, torch_dist.get_rank(group), torch_dist.get_world_size(group), prefix,
                        slots=engine.gradient_accumulation_steps() + 2,
                        timeout=_timeout_of(group, torch.device(engine.device)))


def _timeout_of(group: Any, device: torch.device) -> float:
    """How long ``group`` waits in a collective on ``device`` (a meeting waits as long for a rank that does not come);
    DeepSpeed's default where torch does not say."""
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return default_pg_timeout.total_seconds()


@functools.cache
def joinable_class(engine_class: type) -> type:
    """``engine_class`` with :class:`JoinsUnevenInputs` before it (the same name: it is DeepSpeed's engine)."""
    return type(engine_class.__name__, (JoinsUnevenInputs, engine_class), {"__module__": __name__})


def make_joinable(engine: Any, session: Session) -> None:
    """Give a ``DeepSpeedEngine`` (not a pipeline or hybrid engine) :class:`JoinsUnevenInputs`, and its state."""
    if type(engine) is DeepSpeedEngine:
        engine.__class__ = JoinableDeepSpeedEngine
        engine._join_config = _JoinConfig.construct_disabled_join_config()
        uneven = state_of(engine, session).uneven = UnevenInputs()
        uneven.progress = _progress_of(engine, session)


#: Checked at import like the other safe classes (``wrappers.OVERRIDING``).
JoinableDeepSpeedEngine = joinable_class(DeepSpeedEngine)

__all__ = ["JoinsUnevenInputs", "UnevenInputsError", "joinable_class", "make_joinable"]
