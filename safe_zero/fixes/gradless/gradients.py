"""What a :class:`~safe_zero.fixes.gradless.planner.Planner` needs from torch and the optimizer: autograd's
reachability and the parameters per data-parallel group (:class:`OptimizerView`), and zero gradients."""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import torch
from torch._utils import _unflatten_dense_tensors
from torch.autograd.graph import _get_grad_fn_or_grad_acc

from safe_zero.errors import ReentrantCheckpointWarning
from safe_zero.fixes.gradless import FIX
from safe_zero.session import Session


class Reachability:
    """Whether the running backward will execute each parameter's gradient accumulator (as DeepSpeed's own
    ``count_used_parameters_in_backward`` asks).

    Finding a leaf's accumulator costs a view and its autograd node (about 5 us); ZeRO-1/2 asks about its agreed
    order's parameters in each backward that comes out of turn, so there the accumulators are held (``hold``), as
    DDP's reducer holds them, and autograd reuses them; those of the last list asked about are kept beside it, so a
    walk's ask, about the same list each time, is one C loop over them. Not on ZeRO-3: it re-points a partitioned
    parameter at an empty tensor between uses, and a held accumulator keeps the shape the parameter had when it was
    made.
    """

    def __init__(self, hold: bool) -> None:
        self._held: dict[int, Any] | None = {} if hold else None
        self._last: tuple[Sequence[torch.Tensor], list[Any]] | None = None

    def __call__(self, params: Sequence[torch.Tensor]) -> list[bool]:
        held = self._held
        if held is not None:
            last = self._last
            if last is not None and last[0] is params:
                return list(map(torch._C._will_engine_execute_node, last[1]))
            try:  # C loops (map), no Python per parameter
                nodes = list(map(held.__getitem__, map(id, params)))
            except KeyError:  # the first ask for some of them
                with torch.enable_grad():  # hooks run with grad mode off; a leaf's accumulator needs it on
                    held.update((id(p), _get_grad_fn_or_grad_acc(p)) for p in params if id(p) not in held)
                nodes = list(map(held.__getitem__, map(id, params)))
            if None not in nodes:
                self._last = (params, nodes)
                return list(map(torch._C._will_engine_execute_node, nodes))
        else:
            with torch.enable_grad():  # hooks run with grad mode off; a leaf's accumulator needs it on
                nodes = [_get_grad_fn_or_grad_acc(p) for p in params]
        will_execute = torch._C._will_engine_execute_node
        return [node is not None and will_execute(node) for node in nodes]


class OptimizerView:
    """The planner's :class:`~safe_zero.fixes.gradless.planner.Optimizer` on a ZeRO optimizer (``optimizer``, a
    ``PlannerAdapter``): its trainable parameters per data-parallel group, autograd's reachability
    (``hold_accumulators``: see :class:`Reachability`, ZeRO-1/2 only), and its session's ranks; the session is told
    once that reentrant checkpointing holds gradients for the epilogue."""

    def __init__(self, optimizer: Any, session: Session, hold_accumulators: bool) -> None:
        self.agreed_groups = optimizer._reduced_params_by_group
        self.ordered_groups = optimizer._ordered_params_by_group
        self.reached = Reachability(hold_accumulators)
        self.ranks = session.ranks
        self._session = session
        self._warned = False

    def nested_backward(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn("reentrant activation checkpointing (use_reentrant=True) at more than one data-parallel "
                          "rank: the gradients of checkpointed blocks are reduced at the end of the backward, held "
                          "in full until then, so that every rank reduces the same parameters in the same order. "
                          "Non-reentrant checkpointing (use_reentrant=False, e.g. Trainer's gradient_checkpointing_"
                          'kwargs={"use_reentrant": False}) keeps DeepSpeed\'s overlap and memory.',
                          ReentrantCheckpointWarning, stacklevel=5)
            self._session.engaged(FIX, "reentrant activation checkpointing: checkpointed blocks' gradients reduced "
                                       "at the end of the backward")


#: Elements per zeroed buffer that a run of zero gradients is carved from: one fill per run instead of one
#: allocation and fill per parameter, bounded because DeepSpeed frees each gradient as it buckets it and a run of
#: unused experts can be gigabytes.
ZERO_FILL_CHUNK = 1 << 22


def zero_grads_for(wanted: Sequence[tuple[torch.nn.Parameter, torch.Size, Any, str]], reported: set[int],
                   session: Session) -> None:
    """Give each ``(param, shape, device, why)`` of ``wanted`` a zero gradient of its full ``shape`` (also when ZeRO-3
    has already released its data): views of one zeroed buffer per run of the same dtype and device, at most
    ``ZERO_FILL_CHUNK`` elements (a larger parameter gets one of its own). ``session`` is told of each parameter
    once, the first time (its ``id()`` then joins ``reported``)."""
    start, n = 0, len(wanted)
    while start < n:
        dtype, device = wanted[start][0].dtype, wanted[start][2]
        end, total, sizes, as_shaped = start, 0, list[int](), True
        while end < n:
            param, shape, at, _ = wanted[end]
            size = math.prod(shape)
            if sizes and (param.dtype != dtype or at != device or total + size > ZERO_FILL_CHUNK):
                break
            sizes.append(size)
            # torch <= 2.9's unflatten turns a zero-element shape such as (0, 8) into (0,): those take the views.
            total, end, as_shaped = total + size, end + 1, as_shaped and param.shape == shape and size > 0
        run = wanted[start:end]
        flat = torch.zeros(total, dtype=dtype, device=device)
        if as_shaped:  # the views in one C call
            views = _unflatten_dense_tensors(flat, [param for param, _, _, _ in run])
        else:
            views = [z.view(shape) for z, (_, shape, _, _) in zip(flat.split(sizes), run)]
        for (param, shape, _, why), zeros in zip(run, views):
            if param.shape == shape:
                param.grad = zeros
            else:  # a released ZeRO-3 parameter: autograd refuses a grad of another shape; DeepSpeed sets .data
                param.grad = torch.zeros_like(param)
                param.grad.data = zeros
            if id(param) not in reported:
                reported.add(id(param))
                session.engaged(FIX, f"parameter of shape {tuple(shape)} {why}; reduced as zeros")
        start = end
