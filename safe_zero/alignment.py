"""16-byte alignment of grouped_mm expert weights under DeepSpeed.

On CUDA, ``torch._grouped_mm`` / ``F.grouped_mm`` refuse a weight whose ``data_ptr()`` is not a
multiple of 16 ("expected data_ptr to be aligned to 16 bytes"). ZeRO and the fp16/bf16 wrappers
rebind every parameter to a view into one flat buffer; a parameter whose byte size is not a
multiple of 16 (a 2-element attention sink, a 4-element router bias) shifts every view after it
off the 16-byte grid. This module finds the weights that need the grid and decides, once per
``safe_zero.initialize``, how they get it:

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``) on DeepSpeed >= 0.19.7: DeepSpeed's own
  ``zero_optimization.parameter_alignment`` is switched on in the config.
* The routes DeepSpeed does not pad (ZeRO-1 + bf16 + fp32 gradient accumulation, i.e.
  ``BF16_Optimizer``; the fused stage-0 ``FP16_Optimizer``; ZeRO-1/2 on DeepSpeed < 0.19.7) and
  ZeRO-3: ``safe_zero.fixes.grouped_mm_alignment`` lays the flat buffers out so that the weights
  land on the grid (see that module for what was measured on each ZeRO-3 gather path).

The decision depends only on the model and the config, so a resumed run lays its buffers out
exactly like the run that saved the checkpoint.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, TypeVar

import torch
from torch import nn

from safe_zero._compat import DEEPSPEED_PADS_PARAMETERS, DEEPSPEED_VERSION, UNPADDED_ALL_REDUCE_FETCH
from safe_zero.errors import AlignmentError, AlignmentWarning  # noqa: F401  (re-exported)
from safe_zero.options import zero_stage

ALIGNMENT_BYTES = 16

#: ``config._experts_implementation`` values whose kernels need 16-byte aligned weights.
GROUPED_MM_IMPLEMENTATIONS = frozenset({"grouped_mm"})

_MARK = "_safe_zero_grouped_mm"

_Marked = TypeVar("_Marked", bound=nn.Module | nn.Parameter)


def mark_grouped_mm(target: _Marked) -> _Marked:
    """Declare that ``target`` feeds ``torch._grouped_mm`` / ``F.grouped_mm``, so safe_zero keeps it 16-byte aligned.

    For custom layers that Transformers' ``@use_experts_implementation`` detection cannot see.
    A parameter is marked as it is; a module marks its 3-D parameters (the ``(experts, in, out)``
    weights grouped_mm reads; mark any other parameter directly). Returns ``target``, so it can wrap
    a constructor call. Call it before ``safe_zero.initialize``.
    """
    if isinstance(target, nn.Parameter):
        setattr(target, _MARK, True)
    elif isinstance(target, nn.Module):
        for param in target.parameters():
            if len(_shape(param)) == 3:
                setattr(param, _MARK, True)
    else:
        raise TypeError(f"mark_grouped_mm takes an nn.Module or nn.Parameter, got {type(target).__name__}")
    return target


def _shape(param: torch.Tensor) -> torch.Size:
    # A ZeRO-3 partitioned parameter is empty; its real shape is ds_shape.
    return getattr(param, "ds_shape", None) or param.shape


def _experts_forward_code() -> Any:
    """The code object of the forward ``@use_experts_implementation`` installs (shared by every decorated class)."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except Exception:  # transformers missing, or too old to have the decorator
        return None
    probe = type("_SafeZeroProbeExperts", (nn.Module,), {"forward": lambda self: None})
    return use_experts_implementation(probe).forward.__code__


_FORWARD_CODE: Any = ...  # resolved on first use: importing transformers costs seconds


def _is_grouped_mm_experts(module: nn.Module) -> bool:
    global _FORWARD_CODE
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) not in GROUPED_MM_IMPLEMENTATIONS:
        return False
    if _FORWARD_CODE is ...:
        _FORWARD_CODE = _experts_forward_code()
    if _FORWARD_CODE is None:
        return False
    # Decorated classes share one forward closure; a subclass may inherit or wrap it.
    return any(getattr(klass.__dict__.get("forward"), "__code__", None) is _FORWARD_CODE
               for klass in inspect.getmro(type(module)))


def grouped_mm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of ``model`` that must be 16-byte aligned, by qualified name.

    These are the 3-D weights (``gate_up_proj``/``up_proj``, ``down_proj``) of Transformers experts
    modules whose ``config._experts_implementation`` is ``"grouped_mm"`` (the default for every
    ``@use_experts_implementation`` class), plus everything marked with :func:`mark_grouped_mm`.
    The implementation is read now: switching it later (``model.set_experts_implementation``)
    is not seen by an engine already built.
    """
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if _is_grouped_mm_experts(module):
            for param in module.parameters(recurse=False):
                if len(_shape(param)) == 3:
                    found[id(param)] = param
    for param in model.parameters():
        if getattr(param, _MARK, False):
            found[id(param)] = param
    # named_parameters lists a shared parameter once, under its first name.
    return {name: param for name, param in model.named_parameters() if id(param) in found}


def is_aligned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` starts on a 16-byte boundary (what CUDA grouped_mm checks)."""
    return tensor.data_ptr() % ALIGNMENT_BYTES == 0


@dataclass
class AlignmentPlan:
    """What one ``safe_zero.initialize`` does about alignment; kept on the session as ``session.alignment``.

    Attributes:
        params: the weights that need the 16-byte grid, by qualified name.
        active: safe_zero keeps them aligned on every route it reaches.
        guard: check them after initialize and after every optimizer step.
        everything: ``"alignment": true`` - lay out every flat buffer on the grid, detected weights or not.
    """

    params: dict[str, nn.Parameter] = field(default_factory=dict)
    active: bool = False
    guard: bool = False
    everything: bool = False

    def __post_init__(self) -> None:
        self._names = {id(p): n for n, p in self.params.items()}

    def name(self, param: torch.Tensor) -> str | None:
        """The qualified name of ``param`` if it needs alignment, else ``None``."""
        return self._names.get(id(param))

    def needs(self, param: torch.Tensor) -> bool:
        return id(param) in self._names

    def misaligned(self) -> list[tuple[str, int]]:
        """``(name, data_ptr() % 16)`` of each detected weight off the grid now (ZeRO-3: partitioned ones skipped)."""
        off = []
        for name, param in self.params.items():
            if param.numel() and not is_aligned(param):
                off.append((name, param.data_ptr() % ALIGNMENT_BYTES))
        return off

    def check(self, where: str, route: str) -> None:
        """Raise :class:`AlignmentError` naming each detected weight that is off the grid."""
        if not self.guard:
            return
        off = self.misaligned()
        if off:
            listed = ", ".join(f"{name} (data_ptr % 16 = {rem})" for name, rem in off)
            raise AlignmentError(
                f"safe_zero alignment guard: {len(off)} grouped_mm weight(s) are not 16-byte aligned {where} "
                f"on the {route} route: {listed}. CUDA grouped_mm would fail with 'expected data_ptr to be aligned "
                f"to 16 bytes'. {WORKING_CONFIGS}")


WORKING_CONFIGS = (
    'Leave safe_zero\'s grouped_mm_alignment fix on ("safe_zero": {"fixes": {"grouped_mm_alignment": "auto"}}), '
    "which keeps them aligned on ZeRO-1/2, ZeRO-1 + bf16 + fp32 gradient accumulation and fused stage 0; on "
    "DeepSpeed >= 0.19.7 ZeRO-1/2 also pads them itself with zero_optimization.parameter_alignment.")

NO_PLAN = AlignmentPlan()


def plan_for(session: Any) -> AlignmentPlan:
    """The session's plan; a session that never went through :func:`prepare_config` has none."""
    return getattr(session, "alignment", NO_PLAN)


def prepare_config(model: nn.Module | None, config: Mapping[str, Any] | None, session: Any) -> dict[str, Any] | None:
    """Decide alignment for one initialize call; return an adjusted copy of ``config``, or ``None`` to leave it as is.

    Reads ``"safe_zero": {"alignment": "auto" | true | false, "alignment_guard": bool}`` from the
    session's options. With ``"auto"`` (default) alignment is on when the model has grouped_mm
    weights (:func:`grouped_mm_parameters`); ``true`` turns it on regardless; ``false`` turns it
    off, with an :class:`AlignmentWarning` if the model needs it. On ZeRO-1/2 with a DeepSpeed that
    has ``zero_optimization.parameter_alignment`` (>= 0.19.7) it sets that to true unless the user
    set it; a user's explicit ``false`` is respected as an opt-out (with the warning). The plan is
    stored as ``session.alignment``.
    """
    options = session.options
    params = grouped_mm_parameters(model) if isinstance(model, nn.Module) else {}
    zero = dict((config or {}).get("zero_optimization") or {})
    stage = zero_stage(config)
    user_alignment = zero.get("parameter_alignment")

    opted_out = None
    if options.alignment is False:
        opted_out = '"safe_zero": {"alignment": false}'
    elif user_alignment is False and stage in (1, 2):
        opted_out = '"zero_optimization": {"parameter_alignment": false}'
    # The user's parameter_alignment asks for alignment on every route, also those DeepSpeed leaves unpadded
    # (BF16_Optimizer, fused stage 0, ZeRO-3): safe_zero honours it there like "alignment": true.
    everything = opted_out is None and (options.alignment is True or user_alignment is True)
    active = everything or (opted_out is None and bool(params))
    plan = AlignmentPlan(params=params, active=active, guard=active and options.alignment_guard,
                         everything=everything)
    session.alignment = plan

    if active and params and stage == 3 and _tight_all_reduce_fetch(zero) and _world_size() > 1:
        raise AlignmentError(
            f"stage3_use_all_reduce_for_fetch_params on DeepSpeed < 0.19.8 gathers a module's parameters back to "
            f"back, so grouped_mm weight(s) {', '.join(params)} can land off the 16-byte grid (measured 6 bytes on "
            "0.18.9) and CUDA grouped_mm would fail. Turn stage3_use_all_reduce_for_fetch_params off (the default "
            "all-gather keeps gathered weights aligned) or use DeepSpeed 0.19.8, where safe_zero aligns that path.")
    if opted_out and params:
        warnings.warn(
            f"{opted_out} leaves {len(params)} grouped_mm weight(s) (e.g. {next(iter(params))}) where the flat "
            "buffer puts them; any that are not 16-byte aligned make CUDA grouped_mm fail with 'expected data_ptr "
            "to be aligned to 16 bytes'. Remove the setting to let safe_zero align them.",
            AlignmentWarning, stacklevel=3)
    if not active or config is None or stage not in (1, 2) or user_alignment is not None:
        return None
    if not DEEPSPEED_PADS_PARAMETERS:
        return None  # < 0.19.7: safe_zero's ZeRO-1/2 subclass lays the buffer out itself
    adjusted = copy.deepcopy(dict(config))
    adjusted.setdefault("zero_optimization", {})["parameter_alignment"] = True
    return adjusted


def _tight_all_reduce_fetch(zero: Mapping[str, Any]) -> bool:
    """Whether the all-reduce fetch path advances by ``ds_numel`` (0.18.9, measured) rather than by the
    ``ds_numel_aligned`` safe_zero can round (0.19.8); releases in between are treated as the older."""
    on = zero.get("stage3_use_all_reduce_for_fetch_params", zero.get("use_all_reduce_for_fetch_params", False))
    return bool(on) and DEEPSPEED_VERSION in UNPADDED_ALL_REDUCE_FETCH


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padding_bytes(numels: Iterable[int], element_size: int) -> int:
    """Bytes DeepSpeed's ``parameter_alignment`` inserts between parameters of one flat group (none after the last)."""
    per = ALIGNMENT_BYTES // element_size if ALIGNMENT_BYTES % element_size == 0 else 1
    numels = list(numels)
    return sum((-n) % per for n in numels[:-1]) * element_size
