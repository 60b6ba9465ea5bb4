"""Zero-element parameters under ZeRO-3 (every DeepSpeed release up to 0.19.8).

A parameter with no elements (``nn.Linear(8, 0)``, FP-Quant's placeholders) is partitioned
like any other and starts each step ``NOT_AVAILABLE``. DeepSpeed then fails it four ways:

- ``PartitionedParameterCoordinator.fetch_sub_module`` only gathers when the submodule has
  ``fetch_numel > 0`` elements to fetch, so a submodule whose parameters are all empty is
  never gathered and the wait loop asserts ``... 'status': 'NOT_AVAILABLE', 'numel': 0``;
- an empty parameter in a coalesced bucket beside sized ones (world size >= 2) reaches
  ``AllGatherCoalescedHandle.wait``, which concatenates its zero partitions:
  ``ValueError: torch.cat(): expected a non-empty list of Tensors``;
- the prefetch gate (``numel_prefetching > 0``) has the same element-count proxy;
- ``zero_quantized_nontrainable_weights`` quantizes a frozen empty partition and the CUDA
  quantizer's group search divides by zero (``ZeroDivisionError``).

An empty parameter has no bytes to move. This fix makes it available locally (an empty
tensor of its real ``ds_shape``, on the compute device, in ``param.dtype`` -- the dtype its
sized siblings are handed back in, also under weight quantization, where the stored partition
is int8) and releases it through DeepSpeed's own ``partition``, which frees it without any
collective. Collectives never see it: the coordinator materializes it before the stock fetch
runs, and the per-parameter ``all_gather``/``all_gather_coalesced`` that DeepSpeed attaches
to every ZeRO-3 parameter (used by prefetch, ``GatheredParameters``, the 16-bit consolidated
state dict and the persistent-parameter gather after each step) leave it out of the gather.
So a model with empty parameters issues exactly the collectives of the same model without
them, and every rank does the same, because ``ds_numel`` is the same on every rank.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterable, TypeGuard, cast

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer, ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
from deepspeed.utils import z3_leaf_module, zero_to_fp32
from packaging.specifiers import SpecifierSet

from safe_zero.fix import Fix
from safe_zero.patching import overrides, pass_through, swapped
from safe_zero.session import Session, State, session_for, state_of

if TYPE_CHECKING:
    # mypy reads each mixin as the DeepSpeed class it is put before (untyped: its attributes are Any); at run time a
    # mixin subclasses nothing (docs/developing.md, "A new fix").
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as _Offload
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer as _Quantizer
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as _Coordinator
    from deepspeed.utils.zero_to_fp32 import GatheredTensor as _GatheredTensor

    from safe_zero.zero_types import ZeROParameter
else:
    _Offload = _Coordinator = _Quantizer = _GatheredTensor = object

FIX = Fix(
    name="zero3_zero_element_params",
    summary="make zero-element ZeRO-3 parameters available locally and keep them out of every collective",
    needed_on=SpecifierSet(">=0.18.0"),
    probe="safe_zero.probes:probe_zero3_zero_element_params",
)

_ADOPTED = "_safe_zero_zero_element_session"


def is_zero_element(param: torch.nn.Parameter) -> TypeGuard[ZeROParameter]:
    """Whether ``param`` is a ZeRO-3 parameter whose full tensor has no elements."""
    return getattr(param, "ds_numel", None) == 0


def _materialize(param: ZeROParameter) -> None:
    # param.dtype survives partitioning (free_param keeps it) and is what the sized parameters are
    # handed back in, also when their stored partition is int8 (weight quantization).
    param.data = torch.empty(param.ds_shape, dtype=param.dtype, device=get_accelerator().current_device_name())


def materialize_available(params: Iterable[ZeROParameter]) -> int:
    """Make the ``NOT_AVAILABLE`` zero-element parameters among ``params`` ``AVAILABLE``; return how many."""
    count = 0
    for param in params:
        if is_zero_element(param) and param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            _materialize(param)
            param.ds_status = ZeroParamStatus.AVAILABLE
            count += 1
    return count


class _LocalHandle:
    """The handle of a gather whose zero-element parameters moved nothing: they become ``AVAILABLE`` at ``wait``.

    Mirrors DeepSpeed's ``NoGatherCoalescedHandle`` so callers that check for ``INFLIGHT``
    between issuing and waiting (the coordinator does) see the usual state machine. ``sized``
    is the stock handle of the rest of the bucket, waited on first (by keyword: DeepSpeed's
    handles disagree on positional arguments).
    """

    def __init__(self, params: list[ZeROParameter], sized: Any = None) -> None:
        self.params = params
        self.sized = sized
        self.complete = False
        for param in params:
            _materialize(param)
            param.ds_status = ZeroParamStatus.INFLIGHT

    def wait(self, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        if self.sized is not None:
            self.sized.wait(handle_dependency=handle_dependency)
        for param in self.params:
            param.ds_status = ZeroParamStatus.AVAILABLE
        self.complete = True


def _split(params: Iterable[ZeROParameter]) -> tuple[list[ZeROParameter], list[ZeROParameter]]:
    empty: list[ZeROParameter] = []
    sized: list[ZeROParameter] = []
    for param in params:
        (empty if is_zero_element(param) else sized).append(param)
    return empty, sized


def _wrap_all_gather(param: ZeROParameter, session: Session) -> None:
    stock_all_gather = param.all_gather
    stock_all_gather_coalesced = param.all_gather_coalesced

    @functools.wraps(stock_all_gather)
    def all_gather(param_list: Any = None, async_op: bool = False, hierarchy: int = 0) -> Any:
        empty, sized = _split([param] if param_list is None else param_list)
        if not empty:
            return stock_all_gather(param_list, async_op=async_op, hierarchy=hierarchy)
        if materialize_available(empty):
            session.engaged(FIX, "zero-element parameter made available without a collective (all_gather)")
        if sized:
            return stock_all_gather(sized, async_op=async_op, hierarchy=hierarchy)
        return [] if async_op else None

    @functools.wraps(stock_all_gather_coalesced)
    def all_gather_coalesced(params: Iterable[ZeROParameter], *args: Any, **kwargs: Any) -> Any:
        params = list(params)
        empty, sized = _split(params)
        if not empty:
            return stock_all_gather_coalesced(params, *args, **kwargs)
        for p in empty:
            if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                raise RuntimeError(p.ds_summary())  # the same refusal as DeepSpeed's
        session.engaged(FIX, "zero-element parameter left out of a coalesced all-gather")
        sized_handle = stock_all_gather_coalesced(sized, *args, **kwargs) if sized else None
        return _LocalHandle(empty, sized_handle)

    param.all_gather = all_gather
    param.all_gather_coalesced = all_gather_coalesced


def adopt(params: Iterable[torch.nn.Parameter], session: Session) -> int:
    """Route the gathers of these ZeRO-3 parameters around their zero-element members.

    Idempotent per parameter; returns how many parameters were newly adopted. DeepSpeed issues a
    coalesced gather through the first parameter of a bucket, which may be a sized one, so every
    parameter of a model that has zero-element parameters is adopted, not only the empty ones.
    """
    count = 0
    for param in params:
        if not hasattr(param, "ds_id") or getattr(param, _ADOPTED, None) is not None:
            continue
        _wrap_all_gather(cast("ZeROParameter", param), session)  # it has a ds_id: ZeRO-3 converted it
        setattr(param, _ADOPTED, session)
        count += 1
    return count


class ZeroElements:
    """This fix's part of the :class:`~safe_zero.session.State` of an object it extends
    (``obj._safe_zero.zero_element``): the ZeRO-3 coordinator's, or ``safe_zero.Init``'s."""

    __slots__ = ("by_module", "reported", "adopt_each")

    def __init__(self, adopt_each: bool = False) -> None:
        #: The coordinator: module id -> its zero-element parameters (fetches run per submodule per step: look once).
        self.by_module: dict[int, tuple[ZeROParameter, ...]] = {}
        #: The coordinator: whether the session was told that a fetch made some available.
        self.reported = False
        #: ``safe_zero.Init``: whether each parameter is adopted as it is converted (not those of a module given
        #: whole, which is adopted after partitioning, only if it has zero-element parameters).
        self.adopt_each = adopt_each


class MaterializeZeroElementOnFetch(_Coordinator):
    """Mixin for ``PartitionedParameterCoordinator``: empty parameters are made available before the stock fetch.

    DeepSpeed's ``fetch_sub_module`` then sees them ``AVAILABLE``: they add nothing to its
    ``fetch_numel`` gate, never enter a gather bucket, and pass its wait-loop assertion. Its
    own release (``param.partition``) frees them again without a collective.
    """

    _safe_zero: State

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        state_of(self).zero_element = ZeroElements()
        super().__init__(*args, **kwargs)
        if not session_for(self).uses(FIX):  # skip this override at every module entry
            pass_through(self, "fetch_sub_module", MaterializeZeroElementOnFetch)

    @overrides
    def fetch_sub_module(self, current_submodule: torch.nn.Module, forward: bool) -> None:
        part = self._safe_zero.zero_element
        assert part is not None  # set in __init__
        empty = part.by_module.get(id(current_submodule))
        if empty is None:
            empty = part.by_module[id(current_submodule)] = self._zero_element_params(current_submodule)
        if empty and materialize_available(empty) and not part.reported:
            part.reported = True
            session_for(self).engaged(FIX, "zero-element parameters made available at fetch without a collective")
        super().fetch_sub_module(current_submodule, forward)

    def _zero_element_params(self, module: torch.nn.Module) -> tuple[ZeROParameter, ...]:
        """The parameters of ``module`` the stock fetch would leave ``NOT_AVAILABLE`` (none when the fix is off)."""
        if not session_for(self).uses(FIX):
            return ()
        return tuple(p for p in iter_params(module, recurse=z3_leaf_module(module)) if is_zero_element(p))


class AdoptZeroElementParams(_Offload):
    """Mixin for ``DeepSpeedZeRoOffload``: adopt the parameters once DeepSpeed has converted them.

    Runs before the first forward, checkpoint load or ``GatheredParameters`` on the engine.
    A model without zero-element parameters is left untouched.
    """

    @overrides
    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        session = session_for(self)
        params = list(module.parameters()) if session.uses(FIX) else []
        empty = sum(1 for p in params if is_zero_element(p))
        if empty:
            adopt(params, session)
            session.engaged(FIX, f"{empty} zero-element parameter(s) kept out of ZeRO-3 collectives")
        else:  # the coordinator's fetch has nothing to materialize on this model
            pass_through(self.get_param_coordinator(), "fetch_sub_module", MaterializeZeroElementOnFetch)


class GuardEmptyQuantize(_Quantizer):
    """Mixin for ``CUDAQuantizer``: an empty partition quantizes to empty tensors.

    DeepSpeed's group-size search divides by the group count, which is 0 for an empty input
    (``ZeroDivisionError``). The result is int8 values of the input's shape and no float32
    scales, so ``ds_quant_scale`` is set on the partition like on any other; the scales are 1-D
    ``(0,)``, which ``torch.cat`` accepts beside the kernel's ``(groups, 1)`` ones.
    """

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        session_for(self)  # built inside initialize / zero.Init: keep that session for later calls

    @overrides
    def quantize(self, param: torch.Tensor, groups: int | None = None) -> Any:
        if param.numel() == 0 and session_for(self).uses(FIX):
            device = get_accelerator().device_name()
            return (torch.empty(param.shape, dtype=torch.int8, device=device),
                    torch.empty(0, dtype=torch.float32, device=device))
        return super().quantize(param, groups)

    @overrides
    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if quantized_param.numel() == 0 and session_for(self).uses(FIX):
            dtype = kwargs.get("dtype") or (args[0] if args else None) or torch.half  # the kernel's own output dtype
            return torch.empty(quantized_param.shape, dtype=dtype, device=quantized_param.device)
        return super().dequantize(quantized_param, scale, *args, **kwargs)


class SafeCUDAQuantizer(GuardEmptyQuantize, CUDAQuantizer):
    """DeepSpeed's ZeRO-3 weight quantizer with the empty-partition guard."""


class GuardEmptyGatheredTensor(_GatheredTensor):
    """Mixin for ``zero_to_fp32.GatheredTensor``: a zero-element parameter merges to an empty tensor of its shape.

    Before 0.19.8 the ZeRO-3 optimizer keeps zero-element trainable parameters in its groups,
    so the checkpoint lists them among the trainable ones. Merging one searches the flat groups
    for the group holding its empty slice and, when the slice sits at a group's end, finds none:
    ``TypeError: 'NoneType' object cannot be interpreted as an integer``.
    """

    @overrides
    def contiguous(self) -> torch.Tensor:
        if self.shape.numel() == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return super().contiguous()


class SafeGatheredTensor(GuardEmptyGatheredTensor, zero_to_fp32.GatheredTensor):
    """``zero_to_fp32``'s lazy merged parameter with the zero-element guard."""


#: DeepSpeed's own, bound at import: the function below stands in for it inside Lightning's converter
#: (``safe_zero.lightning.convert_zero_checkpoint_to_fp32_state_dict``).
_STOCK_FP32_STATE_DICT = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None, *args: Any,
                                             **kwargs: Any) -> dict[str, torch.Tensor]:
    """``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (same arguments) that
    also reconstructs zero-element parameters, with their real shape, from checkpoints of any
    supported DeepSpeed release.

    ZeRO-1/2 checkpoints record a zero-element parameter nowhere zero_to_fp32 looks when no optimizer
    group holds it (DeepSpeed 0.19.8, and safe_zero's ``zero_element_groups`` before it) and frozen
    parameters are not saved (ZeRO-1; ZeRO-2 before 0.19.8); the module state saved beside them has it,
    with its shape, and it has no values to lose.
    """
    with swapped(zero_to_fp32, "GatheredTensor", SafeGatheredTensor):
        state = _STOCK_FP32_STATE_DICT(checkpoint_dir, tag, *args, **kwargs)
    for name, shape in _zero_element_module_params(checkpoint_dir, tag).items():
        state.setdefault(name, torch.empty(shape, dtype=torch.float32))
    return state


def _zero_element_module_params(checkpoint_dir: str, tag: str | None) -> dict[str, torch.Size]:
    """Name -> shape of the zero-element parameters in a ZeRO-1/2 checkpoint's saved module state."""
    import glob
    import os

    if tag is None:
        with open(os.path.join(checkpoint_dir, "latest")) as f:
            tag = f.read().strip()
    files = sorted(glob.glob(os.path.join(checkpoint_dir, tag, "mp_rank_*_model_states.pt")))
    if not files:  # ZeRO-3 names its files zero_pp_rank_*: its param_shapes list every parameter
        return {}
    saved = torch.load(files[0], map_location="cpu", weights_only=False)
    buffers = set(saved.get("buffer_names") or ())
    return {name: t.shape for name, t in (saved.get("module") or {}).items()
            if torch.is_tensor(t) and t.numel() == 0 and name not in buffers}
