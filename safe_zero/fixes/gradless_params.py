"""Trainable parameters without a gradient on some or all ranks (every DeepSpeed release up to 0.19.8).

DDP's rule (``find_unused_parameters=True``) is the reference: a parameter a rank did not use
contributes a zero gradient to the average, so data-parallel training equals single-process
training on the global batch. Stock ZeRO breaks it three ways:

- **No gradient although the hook fires.** A parameter whose autograd function returns ``None``
  for it (FP-Quant's ``dqweight`` without master weights) still fires its post-accumulate-grad
  hook. ZeRO-2 then reads ``param.grad.view`` (``AttributeError: 'NoneType' object has no
  attribute 'view'``, ``stage_1_and_2.py`` ``reduce_independent_p_g_buckets_and_remove_grads``)
  and ZeRO-3 ``param.grad.numel()`` (``stage3.py`` ``__add_grad_to_ipg_bucket``).
- **Ranks that use different parameters (ZeRO-1/2).** ZeRO-2 (and ZeRO-1 with ``overlap_comm``)
  appends each gradient to its reduce bucket in the order the hooks fire
  (0.19.8 ``stage_1_and_2.py:1414-1470`` ``reduce_independent_p_g_buckets_and_remove_grads``) and
  reduces the bucket as one flat tensor (``average_tensor``). When rank 0 used experts 0 and 1 and
  rank 1 experts 2 and 3, the buckets hold different parameters at the same offsets and the
  all-reduce adds expert 0's gradient to expert 2's: every step trains silently wrong.
  ZeRO-1 without ``overlap_comm`` walks the groups in order but skips parameters whose gradient
  is ``None`` (``reduce_gradients``, ``stage_1_and_2.py:958-980``): the same mix-up.
- **The same for ZeRO-3 parameters outside leaf modules** (``stage3.py``
  ``reduce_ready_partitions_and_remove_grads`` -> ``__add_grad_to_ipg_bucket``, hook order).

The fix has one mechanism for all of them. In the first backward that reduces, each rank asks
autograd which trainable parameters this backward will reach (``torch._C._will_engine_execute_node``,
as DeepSpeed's own ``count_used_parameters_in_backward`` does), and the ranks agree in one all-reduce
(MIN over a ``uint8`` flag per parameter, one byte per trainable parameter, per data-parallel group):
on ZeRO-1/2 at its first gradient hook, in the background, hooks that fire before it lands waiting in
a queue in arrival order; on ZeRO-3 where the backward enters its first module, before any gather.
Parameters every rank reaches go through DeepSpeed's hook path unchanged, in the order their hooks
fired. The others are held back and reduced at the backward's epilogue, in parameter order, on every
rank, with a zero gradient where a rank has none -- also when no rank has one, like a parameter whose
hook fired with ``None``. So every rank reduces the same tensors in the same layout. There is no
agreement at world size 1, nor on ZeRO-1 without ``overlap_comm``, whose single ordered pass only
needs the zeros.

Only the sequence of a backward's collectives has to match across ranks, not their timing. So the
agreement runs in the first reducing backward only, whose epilogue broadcasts rank 0's hook order once
(``ReductionOrder``). From then on each rank walks that order without any collective: a parameter goes
to DeepSpeed once its hook has fired, or at once with a zero gradient where the running backward will
not reach it, and never ahead of those before it. On a model where every rank uses every parameter the
hooks fire in that order, so each is handed over as it fires, as stock does, and nothing is added per
step. ZeRO-3 also gathers parameters during backward, module by module, and its bucket flushes must
fall between the same gathers on every rank. The coordinator counts the modules each forward and
backward enters (the module clock, the same on every rank while they follow DeepSpeed's recorded
module order), the order records the clock at which each of rank 0's hooks fired, and each rank hands
a parameter over once the clock has reached that value and, where its hook will not fire, before the
next module's gathers. When every rank leaves the recorded module order at the same module (they agree
on it through the store, see below), the rest of that backward is reduced at its epilogue and the next
backward agrees again. Reentrant activation checkpointing runs nested backwards the outer graph does
not show: seen in the first backward, the agreement stays; begun later, every rank stops before the
update with what to do.

``"find_unused_parameters": false`` (DDP's default contract: every rank uses every parameter) drops the
all-reduce and checks, locally at the epilogue, that every trainable parameter's hook fired
(``UnusedParameterError`` if not). Inside DeepSpeed's ``coalesce_grad_reduction``
(0.19.x) the hooks do not reduce; the flush at the block's exit does, for the parameters that have a gradient on
that rank. There every trainable parameter without one gets a zero gradient at the end of each backward, so every
rank flushes the same parameters, without a collective.

ZeRO-3 gathers parameters module by module, so a module that some ranks skip also desynchronises
the gathers. MoE blocks whose experts are separate modules are therefore made ZeRO-3 leaf modules
(``safe_zero.leaf_modules``): gathered whole on every rank, with DeepSpeed's leaf backward hook
zero-filling the experts a rank did not use. A module that some ranks never enter (an optional
tower) cannot be a leaf; the ``"optional_modules"`` it is listed in keep its parameters gathered on
every rank, out of the fetch/release trace (``KeepsOptionalModulesGathered``), and its gradients take
the agreement above. Without that listing, while DeepSpeed records its module trace (the first
forward, and again after any change of module order) the ranks agree on each module before its
gather, and stop together with an error that names the modules and the setting
(``AgreesOnModulesWhileRecording``), where stock would hang in the gather or stop a step later in
``assert_ints_same_as_other_ranks`` (``partitioned_param_coordinator.py`` ``reset_step``).

What happens to a value: a zero gradient leaves a parameter that no rank used bit-identical under
Adam/AdamW and SGD without weight decay (Adam's update is ``0 / (0 + eps) = 0`` until it has
momentum). Decoupled weight decay still applies, as to any parameter in its group.
"""

from __future__ import annotations

import datetime
import itertools
import warnings
from typing import Any, Iterable

import torch
from packaging.specifiers import SpecifierSet

from safe_zero.errors import RankDivergenceError, ReentrantCheckpointWarning, UnusedParameterError
from safe_zero.fix import Fix
from safe_zero.patching import overrides
from safe_zero.session import session_for

FIX = Fix(
    name="gradless_params",
    summary="reduce every trainable parameter in one order on every rank, with a zero gradient where a rank has "
            "none (DDP's rule for unused parameters; ZeRO-1/2/3)",
    needed_on=SpecifierSet(">=0.18.0"),
    probe="safe_zero.probes:probe_gradless_params",
)


def _node(param: torch.Tensor) -> Any:
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    with torch.enable_grad():  # hooks run with grad mode off; a leaf's accumulator needs it on
        return _get_grad_fn_or_grad_acc(param)


def _will_reach(node: Any) -> bool:
    """Whether the running backward will execute ``node`` (a parameter's gradient accumulator)."""
    return node is not None and bool(torch._C._will_engine_execute_node(node))


def _reached(params: list[torch.Tensor]) -> list[bool]:
    """Whether the running backward will reach each parameter's gradient accumulator."""
    return [_will_reach(_node(p)) for p in params]


class Agreement:
    """Which parameters of one backward some rank does not reach, agreed by an all-reduce that runs in the background.

    Hooks that fire before the answer lands are queued in arrival order and reduced, in that order, once it
    has: every rank then hands DeepSpeed the same parameters in the same sequence, whenever its own answer
    arrived, so the buckets and their collectives still match. The parameters some rank misses are held for
    the epilogue.
    """

    def __init__(self, graph_task: int, params_by_group: Iterable[tuple[Any, list[torch.Tensor]]]) -> None:
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator

        self.graph_task = graph_task
        self.queued: list[tuple[torch.nn.Parameter, tuple]] = []
        self.arrived: list[torch.nn.Parameter] = []  # every reducing hook's parameter, in the order they fired
        self.clocks: dict[int, int] = {}  # ZeRO-3: per parameter, the module clock at its first hook
        self._held: set[int] | None = None
        self._pending = []
        for group, params in params_by_group:
            if params:
                device = get_accelerator().current_device_name()
                flags = torch.tensor(_reached(params), dtype=torch.uint8, device=device)
                work = dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group, async_op=True)
                self._pending.append((params, flags, work))

    def known(self, wait: bool = False) -> bool:
        """Whether the answer is in (``wait``: wait for it)."""
        if self._held is None:
            if not wait and not all(work.is_completed() for _, _, work in self._pending):
                return False
            held: set[int] = set()
            for params, flags, work in self._pending:
                work.wait()
                held.update(id(p) for p, everywhere in zip(params, flags.tolist()) if not everywhere)
            self._held, self._pending = held, []
        return True

    @property
    def held(self) -> set[int]:
        self.known(wait=True)
        return self._held

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self.held


#: The due clock of a parameter rank 0's first backward did not reach: it is handed over at the epilogue.
AT_EPILOGUE = 2**62


class ReductionOrder:
    """The one order in which every rank hands DeepSpeed its trainable parameters, per data-parallel group.

    Only the sequence of a backward's collectives must match across ranks, not their timing. So the first
    reducing backward runs under an ``Agreement``, and at its epilogue the ranks take rank 0's hook order (the
    parameters it did not reach after it, in parameter order), broadcast once. From then on each rank walks
    that order alone (``_Walk``): a parameter goes to DeepSpeed once its hook has fired, or at once with a zero
    gradient where this rank's backward will not reach it, and never ahead of the parameters before it. A rank
    whose hooks fire in rank 0's order (every rank uses every parameter) hands each one over as it fires, as
    stock does: no collective per step.

    ZeRO-3 also gathers parameters during backward, module by module, so there the order carries ``due``: the
    module clock (``AgreesOnModulesWhileRecording``) at which each hook fired on rank 0. A parameter is handed
    over once the clock has reached its due value and, where its hook will not fire, before the gathers of the
    next module.
    """

    def __init__(self, sequences: list[list[torch.nn.Parameter]], args: dict[int, tuple],
                 due: dict[int, int] | None = None) -> None:
        self.sequences = sequences
        self.args = args  # the hook arguments DeepSpeed registered for each parameter (its group index)
        self.due = due
        self.slot = {id(p): (s, k) for s, sequence in enumerate(sequences) for k, p in enumerate(sequence)}


class _Walk:
    """One backward's progress along a ``ReductionOrder``."""

    def __init__(self, order: ReductionOrder, graph_task: int) -> None:
        self.order = order
        self.graph_task = graph_task
        self.next = [0] * len(order.sequences)  # per sequence: the first parameter not yet handed over
        self.fired: dict[int, tuple] = {}  # parameters whose hook fired, waiting for the ones before them
        #: ZeRO-3: every rank left the module order at the same point; the rest is handed over at the epilogue.
        self.holding = False


def zero_grad_for(wrapper: Any, param: torch.nn.Parameter, shape: torch.Size, device: Any,
                  why: str = "had no gradient") -> None:
    """Give ``param`` a zero gradient of its full ``shape`` (also when ZeRO-3 has already released its data)."""
    zeros = torch.zeros(shape, dtype=param.dtype, device=device)
    if param.shape == zeros.shape:
        param.grad = zeros
    else:  # a released ZeRO-3 parameter: autograd refuses a grad of another shape, DeepSpeed sets .data the same way
        param.grad = torch.zeros_like(param)
        param.grad.data = zeros
    if not getattr(param, "_safe_zero_gradless_reported", False):
        session_for(wrapper).engaged(FIX, f"parameter of shape {tuple(shape)} {why}; reduced as zeros")
        param._safe_zero_gradless_reported = True


class _AgreesOnReducedParams:
    """Per-backward agreement shared by the ZeRO-1/2 and ZeRO-3 mixins.

    ``_reduce_now(param, *args)`` is the stock hook body (with a zero gradient where the hook saw none).
    """

    _safe_zero_agreement: Agreement | None = None
    #: ``"find_unused_parameters": false``: ids of the parameters whose hook fired in this backward.
    _safe_zero_fired: set[int] | None = None
    #: Whether the bucket reductions are a backward's only collectives (ZeRO-1/2). Then hooks may queue while
    #: the agreement is in flight. ZeRO-3 also gathers parameters during backward: a queue would move its
    #: reductions past those gathers on some ranks only, so there the agreement is waited for.
    _bucket_reductions_only: bool = False
    _safe_zero_order: ReductionOrder | None = None
    _safe_zero_walk: _Walk | None = None
    #: A backward ran nested autograd tasks (reentrant checkpointing): the outer graph does not show what it reaches.
    _safe_zero_nested: bool = False

    def _reduced_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        raise NotImplementedError

    def _reduce_now(self, param: torch.nn.Parameter, *args: Any) -> None:
        raise NotImplementedError

    def _agreement(self) -> Agreement:
        """This backward's agreement, started at its first reducing hook and ended at its epilogue.

        With reentrant activation checkpointing a checkpointed block's gradients arrive in a nested backward
        (another autograd graph task) of the same ``engine.backward``; the agreement spans it. Their
        accumulators were not in the graph the agreement asked about, so they are held for the epilogue.
        """
        agreement = self._safe_zero_agreement
        if agreement is None:
            agreement = self._safe_zero_agreement = Agreement(torch._C._current_graph_task_id(),
                                                              self._reduced_params_by_group())
        elif agreement.graph_task != torch._C._current_graph_task_id():
            self._warn_nested_backward()
        return agreement

    @overrides
    def enter_backward(self) -> None:
        # engine.backward enters here before autograd runs: an agreement left by a backward that never reached
        # its epilogue (an exception) must not decide this one. Reentrant phases re-enter from inside a hook.
        if torch._C._current_graph_task_id() == -1:
            self._safe_zero_agreement = None
            self._safe_zero_walk = None
            self._safe_zero_fired = None
        super().enter_backward()

    def _check_every_param_fired(self) -> None:
        """``"find_unused_parameters": false``: DDP's default contract, checked on this rank at the epilogue
        (before the optimizer step can apply a wrong update), without a collective."""
        fired, self._safe_zero_fired = self._safe_zero_fired, None
        if fired is None:  # no reducing hook ran in this backward (accumulation without reduction, one rank)
            return
        missed = [p for _, group in self._reduced_params_by_group() for p in group if id(p) not in fired]
        if missed:
            names = getattr(self, "param_names", {}) or {}
            shown = [names.get(p, f"parameter of shape {tuple(getattr(p, 'ds_shape', p.shape))}") for p in missed[:5]]
            raise UnusedParameterError(
                f"{len(missed)} trainable parameter(s) got no gradient in this backward on this rank ({shown}), but "
                '"safe_zero": {"find_unused_parameters": false} promises that every rank uses every parameter, so '
                "the ranks' gradient buckets no longer match. Remove that setting (the default, true, lets the ranks "
                "agree on what each used, like DDP's find_unused_parameters=True), or freeze the parameters that are "
                "never used.")

    def _warn_nested_backward(self) -> None:
        # From the next backward on, agree again: the outer graph no longer shows which parameters a rank reaches.
        self._safe_zero_nested, self._safe_zero_order = True, None
        if not getattr(self, "_safe_zero_nested_warned", False):
            self._safe_zero_nested_warned = True
            warnings.warn("reentrant activation checkpointing (use_reentrant=True) at more than one data-parallel "
                          "rank: the gradients of checkpointed blocks are reduced at the end of the backward, held "
                          "in full until then, so that every rank reduces the same parameters in the same order. "
                          "Non-reentrant checkpointing (use_reentrant=False, e.g. Trainer's gradient_checkpointing_"
                          'kwargs={"use_reentrant": False}) keeps DeepSpeed\'s overlap and memory.',
                          ReentrantCheckpointWarning, stacklevel=3)
            session_for(self).engaged(FIX, "reentrant activation checkpointing: checkpointed blocks' gradients "
                                           "reduced at the end of the backward")

    def _trainable_params(self) -> Iterable[torch.nn.Parameter]:
        raise NotImplementedError

    @overrides
    def backward_epilogue(self, *args: Any, **kwargs: Any) -> None:
        # Inside DeepSpeed's coalesce_grad_reduction the hooks only accumulate, and the flush at the block's exit
        # reduces the parameters that have a gradient on this rank, in parameter order (0.19.8 engine.py:3300-3336,
        # _flush_coalesced_reduction_zero12/_zero3): a parameter only some ranks used would shift every later one in
        # the buckets. A zero gradient on every other parameter makes every rank's flush reduce the same ones; no
        # collective is needed, so this holds with "find_unused_parameters": false too.
        if getattr(self, "_coalesce_grad_reduction", False) and session_for(self).uses(FIX) \
                and _data_parallel_world(self) > 1:
            for param in self._trainable_params():
                if param.grad is None:
                    self._zero_fill(param, "was not used on this rank")
        super().backward_epilogue(*args, **kwargs)

    def _module_clock(self) -> int | None:
        """ZeRO-3: the modules entered so far in this forward and backward (``None``: ZeRO-1/2, no clock)."""
        return None

    def _walks(self) -> bool:
        """Whether the order agreed at this epilogue can be walked in the next backwards."""
        return True

    def _reduce_agreed(self, param: torch.nn.Parameter, *args: Any) -> None:
        """The hook body under the agreement: queue until it is known, then reduce what every rank reached."""
        if torch._C._current_graph_task_id() == -1:
            # No backward is running (DeepSpeed's coalesce_grad_reduction flushes from its context's exit): there
            # is no graph to ask, and DeepSpeed calls in parameter order on every rank anyway.
            self._reduce_now(param, *args)
            return
        if not session_for(self).options.find_unused_parameters:
            if self._safe_zero_fired is None:
                self._safe_zero_fired = set()
            self._safe_zero_fired.add(id(param))
            self._reduce_now(param, *args)
            return
        if self._safe_zero_walk is not None or self._safe_zero_order is not None:
            self._reduce_in_order(param, *args)
            return
        agreement = self._agreement()
        agreement.arrived.append(param)
        clock = self._module_clock()
        if clock is not None:
            agreement.clocks.setdefault(id(param), clock)
        if not agreement.known(wait=not self._bucket_reductions_only):
            agreement.queued.append((param, args))
            return
        self._drain(agreement)
        if not agreement.holds(param):
            self._reduce_now(param, *args)

    def _drain(self, agreement: Agreement) -> None:
        queued, agreement.queued = agreement.queued, []
        for param, args in queued:
            if not agreement.holds(param):
                self._reduce_now(param, *args)

    def _finish_agreement(self, held_in_order: Iterable[tuple[torch.nn.Parameter, tuple]]) -> None:
        """At the epilogue: reduce what is still queued, then the held parameters, in parameter order."""
        if not session_for(self).options.find_unused_parameters:
            self._check_every_param_fired()
        walk, self._safe_zero_walk = self._safe_zero_walk, None
        if walk is not None:
            for sequence in range(len(walk.order.sequences)):
                self._hand_over(walk, sequence, finish=True)
            return
        agreement, self._safe_zero_agreement = self._safe_zero_agreement, None
        if agreement is None:
            return
        held_in_order = list(held_in_order)
        agreement.known(wait=True)
        self._drain(agreement)
        if agreement.held and not getattr(self, "_safe_zero_held_reported", False):
            session_for(self).engaged(FIX, "parameters some ranks did not use were reduced in parameter order "
                                           "with zero gradients from those ranks")
            self._safe_zero_held_reported = True
        for param, args in held_in_order:
            if id(param) in agreement.held:
                if param.grad is None:
                    self._zero_fill(param, "was not used on this rank")
                self._reduce_now(param, *args)
        if self._walks() and not self._safe_zero_nested:
            clocks = agreement.clocks if self._module_clock() is not None else None
            self._safe_zero_order = self._agree_on_order(agreement.arrived, {id(p): a for p, a in held_in_order},
                                                         clocks)

    def _ordered_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        """The parameters a ``ReductionOrder`` sequences, per data-parallel group."""
        return self._reduced_params_by_group()

    def _agree_on_order(self, arrived: list[torch.nn.Parameter], args: dict[int, tuple],
                        clocks: dict[int, int] | None) -> ReductionOrder:
        """Rank 0's hook order of this backward, the parameters it did not reach after it (and on ZeRO-3 the
        module clock of each hook): one broadcast per group."""
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator

        sequences, due = [], ({} if clocks is not None else None)
        for group, params in self._ordered_params_by_group():
            if not params:
                continue
            index = {id(p): k for k, p in enumerate(params)}
            mine = list(dict.fromkeys(index[id(p)] for p in arrived if id(p) in index))
            mine += sorted(set(range(len(params))) - set(mine))
            rows = [mine] if clocks is None else [mine, [clocks.get(id(params[k]), AT_EPILOGUE) for k in mine]]
            order = torch.tensor(rows, dtype=torch.int64, device=get_accelerator().current_device_name())
            dist.broadcast(order, src=dist.get_global_rank(group, 0), group=group)
            sequence = [params[k] for k in order[0].tolist()]
            sequences.append(sequence)
            if due is not None:
                due.update(zip((id(p) for p in sequence), order[1].tolist()))
        return ReductionOrder(sequences, args, due)

    def _current_walk(self) -> _Walk:
        """This backward's walk along the agreed order, begun at its first hook or module boundary."""
        task = torch._C._current_graph_task_id()
        walk = self._safe_zero_walk
        if walk is None:
            walk = self._safe_zero_walk = _Walk(self._safe_zero_order, task)
        elif walk.graph_task != task:
            # A nested backward (reentrant checkpointing) reaches parameters the outer graph did not show, some of
            # which may already have been handed over as zeros. Every rank runs the same checkpointed blocks, so
            # every rank stops here, before the update; the next backwards agree again instead of walking.
            self._warn_nested_backward()
            raise RankDivergenceError(
                "a nested backward (reentrant activation checkpointing, use_reentrant=True) began after the first "
                "step: its gradients may already have been reduced as zeros, so this step's update would be wrong. "
                "Enable reentrant checkpointing before the first step (safe_zero then reduces such gradients at the "
                "end of each backward), or use non-reentrant checkpointing (use_reentrant=False, e.g. "
                'gradient_checkpointing_kwargs={"use_reentrant": False}).')
        return walk

    def _reduce_in_order(self, param: torch.nn.Parameter, *args: Any) -> None:
        """The hook body once the order is agreed: hand over, in that order, what is ready (no collective)."""
        if not getattr(param, "ds_grad_is_ready", True):
            # ZeRO-3 tiled compute: one of several hooks for this parameter in this backward; DeepSpeed only adds
            # the last one to its bucket, so that one is what keeps its place in the order.
            self._reduce_now(param, *args)
            return
        walk = self._current_walk()
        slot = walk.order.slot.get(id(param))
        if slot is None:  # made trainable after the order was agreed: nothing to keep in step with
            self._reduce_now(param, *args)
            return
        walk.fired[id(param)] = args
        if not walk.holding:
            # On ZeRO-3 a parameter whose hook will not fire waits for the next module boundary: asking autograd
            # about the next parameter at every hook costs more than the wait.
            clock = self._module_clock()
            self._hand_over(walk, slot[0], clock=clock, ask=clock is None)

    def _hand_over(self, walk: _Walk, sequence: int, finish: bool = False, clock: int | None = None,
                   ask: bool = True) -> None:
        """Reduce the parameters of ``sequence`` from its first one not yet handed over, while each is ready:
        fired, or not reached by this rank's backward (at the epilogue: every one left; ``ask=False``: only
        fired), and due by ``clock``.

        One reached whose hook has not fired yet stops the walk until it fires. On ZeRO-3 that can be past a
        module's gathers where the agreed order has it before them: the ranks then still reduce in one order if
        its gradient moved on every rank alike, and as stock does (each bucket sorted by parameter) if not.
        """
        params, k = walk.order.sequences[sequence], walk.next[sequence]
        due = walk.order.due
        while k < len(params):
            param = params[k]
            if clock is not None and due is not None and due[id(param)] > clock:
                break
            args = walk.fired.pop(id(param), None)
            if args is None:
                # Asked afresh: a held accumulator would be reused by the next forward, with the shape the parameter
                # had when it was made (a released ZeRO-3 parameter's is empty).
                if not finish and (not ask or _will_reach(_node(param))):
                    break
                args = walk.order.args[id(param)]
                if param.grad is None:
                    self._zero_fill(param, "was not used on this rank")
            self._reduce_now(param, *args)
            k += 1
        walk.next[sequence] = k


def _data_parallel_world(wrapper: Any) -> int:
    # Asked per parameter per step; the group is fixed for the optimizer's life.
    world = getattr(wrapper, "_safe_zero_dp_world", None)
    if world is None:
        from deepspeed import comm as dist

        world = wrapper._safe_zero_dp_world = dist.get_world_size(group=wrapper.dp_process_group)
    return world


class ReduceInOneOrderStage12(_AgreesOnReducedParams):
    """Mixin for ``DeepSpeedZeroOptimizer`` (ZeRO-1/2, every reduction route)."""

    _bucket_reductions_only = True

    def _reduced_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        for i, group in enumerate(self.bit16_groups):
            process_group = self.real_dp_process_group[i]
            by_group.setdefault(id(process_group), (process_group, []))[1].extend(
                p for p in group if p.requires_grad)
        return list(by_group.values())

    def _trainable_params(self) -> Iterable[torch.nn.Parameter]:
        return (p for group in self.bit16_groups for p in group if p.requires_grad)

    def _reduces_in_hooks(self) -> bool:
        # The conditions of stock process_gradients / reduce_ready_partitions_and_remove_grads: else the hooks
        # only accumulate (or DeepSpeed's coalesce_grad_reduction defers them itself).
        if getattr(self, "_coalesce_grad_reduction", False) or not (self.partition_gradients or self.overlap_comm):
            return False
        boundary = self.is_gradient_accumulation_boundary  # a method since 0.19, a flag before
        return bool(self.partition_gradients or (boundary() if callable(boundary) else boundary))

    def _zero_fill(self, param: torch.nn.Parameter, why: str) -> None:
        if self.use_grad_accum_attribute and param.grad is None and getattr(param, "grad_accum", None) is not None:
            return  # earlier micro-steps left it a gradient
        zero_grad_for(self, param, param.shape, param.device, why)

    def _reduce_now(self, param: torch.nn.Parameter, i: int) -> None:
        if param.grad is None:
            self._zero_fill(param, "had no gradient")
        super().process_gradients(param, i)

    @overrides
    def process_gradients(self, param: torch.nn.Parameter, i: int) -> None:
        # Runs per parameter per step: the cheap tests first.
        if not session_for(self).uses(FIX):
            super().process_gradients(param, i)
        elif self._reduces_in_hooks() and _data_parallel_world(self) > 1:
            self._reduce_agreed(param, i)
        else:
            self._reduce_now(param, i)

    @overrides
    def reduce_gradients(self, pipeline_parallel: bool = False) -> None:
        # ZeRO-1 without overlap_comm reduces in one ordered pass here, skipping None gradients: fill them.
        if session_for(self).uses(FIX) and not self.overlap_comm:
            for group in self.bit16_groups:
                for param in group:
                    if param.requires_grad and self.get_gradient_for_reduction(param) is None:
                        self._zero_fill(param, "was not used on this rank")
        super().reduce_gradients(pipeline_parallel)

    @overrides
    def independent_gradient_partition_epilogue(self) -> None:
        self._finish_agreement((param, (i,)) for i, group in enumerate(self.bit16_groups) for param in group)
        super().independent_gradient_partition_epilogue()


class ReduceInOneOrderStage3(_AgreesOnReducedParams):
    """Mixin for ``DeepSpeedZeroOptimizer_Stage3``: the same for parameters outside ZeRO-3 leaf modules
    (a leaf module's backward hook already reduces all of its parameters, zero-filled, in order), walked
    on the coordinator's module clock (``AgreesOnModulesWhileRecording``)."""

    #: The coordinator whose module clock this optimizer's walk follows (safe_zero's, else ``None``: no walk).
    _safe_zero_coordinator: Any = None

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        coordinator = self.parameter_offload.get_param_coordinator()
        if isinstance(coordinator, AgreesOnModulesWhileRecording):
            self._safe_zero_coordinator = coordinator
            coordinator._safe_zero_reducer = self

    def _reduced_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        from deepspeed.utils import z3_leaf_parameter

        params = [p for group in self.fp16_groups for p in group if p.requires_grad and not z3_leaf_parameter(p)]
        return [(self.dp_process_group, params)]

    def _ordered_params_by_group(self) -> list[tuple[Any, list[torch.Tensor]]]:
        # Leaf-module parameters keep their place too: their hook hands them over between the others'.
        return [(self.dp_process_group, list(self._trainable_params()))]

    def _trainable_params(self) -> Iterable[torch.nn.Parameter]:
        # Leaf-module parameters too: a leaf module some rank never entered has no gradient there either.
        return (p for group in self.fp16_groups for p in group if p.requires_grad)

    def _module_clock(self) -> int | None:
        coordinator = self._safe_zero_coordinator
        return None if coordinator is None else coordinator._safe_zero_position

    def _walks(self) -> bool:
        # A trace left during this step: the next one records the module order again, and agrees again.
        coordinator = self._safe_zero_coordinator
        return coordinator is not None and not coordinator.is_invalid_trace()

    def _reduces_in_one_order(self) -> bool:
        """Whether the hooks go through the agreement or the walk (else straight to DeepSpeed)."""
        return (session_for(self).uses(FIX) and _data_parallel_world(self) > 1
                and not getattr(self, "_coalesce_grad_reduction", False))

    def _at_module_boundary(self, clock: int) -> None:
        """The coordinator enters a module in this backward, ``clock`` modules after the forward began; its
        gathers follow. Every rank is at the same point here, so: start this backward's agreement (before its
        first gather), or hand over every parameter due by ``clock``."""
        if (torch._C._current_graph_task_id() == -1 or not self._reduces_in_one_order()
                or not session_for(self).options.find_unused_parameters):
            return
        if self._safe_zero_walk is None and self._safe_zero_order is None:
            self._agreement()
            return
        walk = self._current_walk()
        if not walk.holding:
            self._hand_over(walk, 0, clock=clock)

    def _left_the_trace(self) -> None:
        """Every rank left DeepSpeed's recorded module order at the same module: the clock's due values no longer
        hold. The rest of a backward in progress is handed over at its end; the next one agrees again."""
        self._safe_zero_order = None
        if self._safe_zero_walk is not None:
            self._safe_zero_walk.holding = True

    def _zero_fill(self, param: torch.nn.Parameter, why: str) -> None:
        from deepspeed.accelerator import get_accelerator

        # The parameter may already be re-partitioned here: size the gradient from ds_shape.
        zero_grad_for(self, param, param.ds_shape, get_accelerator().current_device_name(), why)

    def _reduce_now(self, param: torch.nn.Parameter, *args: Any) -> None:
        if param.grad is None:
            self._zero_fill(param, "had no gradient")
        super().reduce_ready_partitions_and_remove_grads(param, *args)

    @overrides
    def reduce_ready_partitions_and_remove_grads(self, param: torch.nn.Parameter, *args: Any) -> None:
        if not session_for(self).uses(FIX):
            super().reduce_ready_partitions_and_remove_grads(param, *args)
        elif self._reduces_in_one_order():
            self._reduce_agreed(param, *args)
        else:
            self._reduce_now(param, *args)

    @overrides
    def independent_gradient_partition_epilogue(self) -> None:
        self._finish_agreement((param, ()) for group in self.fp16_groups for param in group)
        super().independent_gradient_partition_epilogue()


def _module_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    return list(iter_params(module, recurse=z3_leaf_module(module)))


class KeepsOptionalModulesGathered:
    """Mixin for ``DeepSpeedZeRoOffload``: the ``"optional_modules"`` stay gathered on every rank.

    Their parameters join DeepSpeed's persistent parameters, which the optimizer gathers again after
    every step and checkpoint (``stage3.py`` ``_post_step``, ``checkpoint_event_epilogue``); the
    coordinator leaves their modules out of the trace and gathers them at the start of a forward where
    anything else released them. Also hands the coordinator the module names for its errors.
    """

    @overrides
    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        session = session_for(self)
        if not session.uses(FIX):
            return
        from safe_zero.leaf_modules import optional_modules

        coordinator = self.get_param_coordinator()
        coordinator._safe_zero_names = {m.ds_id: name or type(module).__name__ for name, m in module.named_modules()
                                        if hasattr(m, "ds_id")}
        optional = optional_modules(module, session.options.optional_modules)
        if not optional:
            return
        kept = {id(m) for outer in optional.values() for m in outer.modules()}
        params = list(dict.fromkeys(p for outer in optional.values() for p in outer.parameters()))
        persistent = {id(p) for p in self.persistent_parameters}
        for param in params:
            param.ds_persist = True
            if id(param) not in persistent:
                self.persistent_parameters.append(param)
        coordinator._safe_zero_kept_modules = kept
        coordinator._safe_zero_kept_params = params
        session.engaged(FIX, f"optional module(s) {', '.join(optional)} kept gathered on every rank under ZeRO-3")


def _skippable_candidates(names: list[str]) -> list[str]:
    """The children of the modules' deepest common ancestor on their paths: one of them is what some ranks skip."""
    distinct = list(dict.fromkeys(names))
    common = distinct[0].split(".")
    for name in distinct[1:]:
        parts = name.split(".")
        common = common[:next((k for k, (a, b) in enumerate(zip(common, parts)) if a != b),
                              min(len(common), len(parts)))]
    return list(dict.fromkeys(".".join(name.split(".")[:len(common) + 1]) for name in distinct))


class AgreesOnModulesWhileRecording:
    """Mixin for ``PartitionedParameterCoordinator``: optional modules out of the trace, and one module order.

    - A kept (optional) module is invisible to the trace, the fetch and the release: its parameters are
      gathered at the start of each forward where they are not (a collective every rank makes there).
    - While DeepSpeed records the trace, the ranks all-gather the id of each module with non-empty parameters
      before its gather (one 8-byte element per rank per module, in recording forwards only) and raise the same
      ``RankDivergenceError`` on every rank when they differ. Once the trace is complete, prefetching follows
      it and nothing is added.
    - A rank that then leaves the recorded order cannot ask the others with a collective they might not make.
      It posts the module it entered to the process group's store and waits up to ``"module_order_timeout"``
      seconds for every rank to post at the same point: all did, with the same module, and training goes on
      (DeepSpeed records the order again); otherwise it raises ``RankDivergenceError`` naming the module the
      others ran, instead of hanging in its next gather.
    - The module clock: the modules entered so far in this forward and backward (``_safe_zero_position``), the
      same on every rank while they follow one module order. Every gather of a backward follows a module's
      entry, so the ZeRO-3 optimizer (``_safe_zero_reducer``) is told of each entry before its gathers, and
      hands over there the gradients that rank 0 handed over before that point.
    """

    _safe_zero_names: dict[int, str] = {}
    #: The optimizer whose reductions follow this coordinator's module clock (``ReduceInOneOrderStage3``).
    _safe_zero_reducer: Any = None
    _safe_zero_kept_modules: frozenset[int] | set[int] = frozenset()
    _safe_zero_kept_params: list[torch.nn.Parameter] = []
    #: Coordinators built in this process: the same number on every rank, so it names this engine in the store.
    _safe_zero_built = itertools.count()

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._safe_zero_engine_id = next(AgreesOnModulesWhileRecording._safe_zero_built)
        self._safe_zero_forwards = 0  # forwards begun (reset_step), the same count on every rank
        self._safe_zero_position = 0  # modules entered in this forward and backward, as DeepSpeed's trace counts
        self._safe_zero_recorded: list[int] = []  # the module ids of the trace being or last recorded
        self._safe_zero_recording: list[int] = []

    def _kept(self, module: torch.nn.Module) -> bool:
        return id(module) in self._safe_zero_kept_modules

    @overrides
    def reset_step(self) -> None:
        if self.is_record_trace() and self._safe_zero_recording:
            self._safe_zero_recorded = self._safe_zero_recording
        super().reset_step()
        self._safe_zero_recording = []
        self._safe_zero_forwards += 1
        self._safe_zero_position = 0
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        released = [p for p in self._safe_zero_kept_params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if released:  # released on every rank alike: by an optimizer step, a checkpoint or empty_partition_cache
            released[0].all_gather(param_list=released)

    @overrides
    def trace_prologue(self, sub_module: torch.nn.Module) -> None:
        if self._kept(sub_module):
            return
        if self._safe_zero_reducer is not None and torch._C._current_graph_task_id() != -1:
            self._safe_zero_reducer._at_module_boundary(self._safe_zero_position)
        complete = self.is_complete_trace()
        super().trace_prologue(sub_module)
        position = self._safe_zero_position
        self._safe_zero_position += 1
        if complete and self.is_invalid_trace() and session_for(self).uses(FIX):
            self._agree_on_leaving_the_trace(sub_module, position)
            if self._safe_zero_reducer is not None:
                self._safe_zero_reducer._left_the_trace()

    def _agree_on_leaving_the_trace(self, module: torch.nn.Module, position: int) -> None:
        import torch.distributed as dist

        store_of = getattr(dist.distributed_c10d, "_get_default_store", None)
        if not dist.is_initialized() or dist.get_world_size() < 2 or store_of is None:
            return
        store, rank, world = store_of(), dist.get_rank(), dist.get_world_size()
        prefix = f"safe_zero/module_order/{self._safe_zero_engine_id}/{self._safe_zero_forwards}/{position}/"
        store.set(f"{prefix}{rank}", str(module.ds_id))
        timeout = session_for(self).options.module_order_timeout
        try:
            store.wait([f"{prefix}{r}" for r in range(world)], datetime.timedelta(seconds=timeout))
        except RuntimeError:  # the store's timeout (DistStoreError is a RuntimeError)
            expected = self._safe_zero_recorded[position] if position < len(self._safe_zero_recorded) else None
            raise RankDivergenceError(self._left_alone_message(module, expected, timeout)) from None
        ids = [int(store.get(f"{prefix}{r}")) for r in range(world)]
        if len(set(ids)) > 1:
            raise RankDivergenceError(self._divergence_message(ids))

    def _left_alone_message(self, module: torch.nn.Module, expected: int | None, timeout: float) -> str:
        name = self._safe_zero_names.get(module.ds_id, type(module).__name__)
        other = self._safe_zero_names.get(expected, f"module #{expected}") if expected is not None else None
        ran = f"`{other}`, which" if other else "the module that"
        candidates = _skippable_candidates([name] + ([other] if other else []))
        return (f"under ZeRO-3 this rank entered `{name}` where DeepSpeed's recorded module order has {ran} the other "
                f"ranks are running now: no other rank left the order within {timeout:g} s, so their parameter "
                "gathers no longer match this rank's (stock DeepSpeed hangs here). If the model skips a module for "
                "some inputs (an optional tower, a conditional adapter), list it in the DeepSpeed config: "
                f'"safe_zero": {{"optional_modules": ["{candidates[-1]}"]}} (one of {candidates}); its parameters '
                'then stay gathered on every rank. ("safe_zero": {"module_order_timeout": seconds} sets the wait.)')

    @overrides
    def record_module(self, sub_module: torch.nn.Module) -> None:
        if not self._kept(sub_module):
            super().record_module(sub_module)
            self._safe_zero_recording.append(sub_module.ds_id)

    @overrides
    def fetch_sub_module(self, current_submodule: torch.nn.Module, forward: bool) -> None:
        if self._kept(current_submodule):
            return
        if forward and self.is_record_trace() and session_for(self).uses(FIX):
            # Modules whose parameters are all zero-element gather nothing: no agreement either.
            params = [p for p in _module_params(current_submodule) if p.ds_numel > 0]
            if params:
                self._agree_on_module(current_submodule, params[0].ds_process_group)
        super().fetch_sub_module(current_submodule, forward)

    @overrides
    def release_sub_module(self, submodule: torch.nn.Module, forward: bool = False) -> None:
        if not self._kept(submodule):
            super().release_sub_module(submodule, forward)

    def _agree_on_module(self, module: torch.nn.Module, group: Any) -> None:
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator

        world = dist.get_world_size(group=group)
        if world < 2:
            return
        device = get_accelerator().current_device_name()
        mine = torch.tensor([module.ds_id], dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=group)
        ids = [int(t.item()) for t in everyone]
        if len(set(ids)) > 1:
            raise RankDivergenceError(self._divergence_message(ids))

    def _divergence_message(self, ids: list[int]) -> str:
        names = [self._safe_zero_names.get(i, f"module #{i}") for i in ids]
        ran = ", ".join(f"rank {rank} `{name}`" for rank, name in enumerate(names))
        candidates = _skippable_candidates(names)
        return (f"under ZeRO-3 the ranks entered different modules at the same point of the forward ({ran}), so "
                "their parameter gathers would no longer match (stock DeepSpeed hangs here, or stops a step later "
                "with 'Detected a disagreement on list contents'). If the model skips a module for some inputs (an "
                "optional tower, a conditional adapter), list it in the DeepSpeed config, e.g. "
                f'"safe_zero": {{"optional_modules": ["{candidates[0]}"]}} (one of {candidates}): its parameters '
                "then stay gathered on every rank and it trains as DDP would. If these are experts of one MoE "
                'block, gather the block whole instead: "safe_zero": {"leaf_modules": {"add": ["<block class>"]}}.')
