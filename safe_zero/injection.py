"""Scoped injection of safe_zero's subclasses into ``deepspeed.initialize``.

DeepSpeed looks its wrapper classes up as module globals at call time (REFERENCE §2), so
rebinding those globals for the duration of one ``deepspeed.initialize`` call, under a lock,
and restoring them in ``finally`` reaches every wrapper while leaving any other
``deepspeed.initialize`` in the process stock.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import deepspeed
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from safe_zero import alignment, patching, wrappers
from safe_zero._compat import DEEPSPEED_PADS_PARAMETERS, SUPPORTED_DEEPSPEED, check_deepspeed_supported
from safe_zero.errors import (DeepSpeedDriftError, InjectionError, UnreachableModeError,  # noqa: F401  (re-exported)
                              UnsupportedPrecisionError)
from safe_zero.fixes import zero3_zero_element_params, zero_element_groups
from safe_zero.fixes.gradless_params import blocks_to_gather_whole, make_leaves
from safe_zero.options import SafeZeroOptions, pass_config, resolve_config, zero_stage
from safe_zero.patching import stock_class, swap, swapped
from safe_zero.session import Session, made_current
from safe_zero.uneven_inputs import make_joinable
from safe_zero.zero_init import STOCK_INIT, Init


@dataclass(frozen=True)
class Binding:
    """A module global DeepSpeed reads at call time, and the safe subclass bound there during initialize."""

    module: str
    name: str
    safe: type

    @property
    def stock(self) -> type:
        return stock_class(self.safe)

    def where(self) -> str:
        return f"{self.module}.{self.name}"


BINDINGS: tuple[Binding, ...] = (
    Binding("deepspeed.runtime.engine", "FP16_Optimizer", wrappers.SafeFP16_Optimizer),
    Binding("deepspeed.runtime.engine", "FP16_UnfusedOptimizer", wrappers.SafeFP16_UnfusedOptimizer),
    Binding("deepspeed.runtime.engine", "BF16_Optimizer", wrappers.SafeBF16_Optimizer),
    Binding("deepspeed.runtime.engine", "DeepSpeedZeroOptimizer", wrappers.SafeDeepSpeedZeroOptimizer),
    Binding("deepspeed.runtime.engine", "DeepSpeedZeRoOffload", wrappers.SafeDeepSpeedZeRoOffload),
    Binding("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3",
            wrappers.SafeDeepSpeedZeroOptimizer_Stage3),
    Binding("deepspeed.runtime.zero.stage3", "DeepSpeedZeRoOffload", wrappers.SafeDeepSpeedZeRoOffload),
    Binding("deepspeed.runtime.zero.parameter_offload", "PartitionedParameterCoordinator",
            wrappers.SafePartitionedParameterCoordinator),
    # Partitions a ZeRO-3 model that no zero.Init built; every later gather of its parameters runs on it.
    Binding("deepspeed.runtime.zero.parameter_offload", "Init", wrappers.SafeZeroInit),
    # The pipeline engine tests `type(optimizer) == BF16_Optimizer`; an exact-type check needs the swap too.
    Binding("deepspeed.runtime.pipe.engine", "BF16_Optimizer", wrappers.SafeBF16_Optimizer),
    # ZeRO-3 weight quantizer, built in zero.Init's constructor and in quantize_nontrainable_params.
    Binding("deepspeed.runtime.zero.partition_parameters", "CUDAQuantizer", wrappers.SafeCUDAQuantizer),
    Binding("deepspeed.runtime.zero.stage3", "CUDAQuantizer", wrappers.SafeCUDAQuantizer),
)


def verify_bindings(bindings: tuple[Binding, ...] = BINDINGS) -> None:
    """Raise :class:`DeepSpeedDriftError` if DeepSpeed no longer has a name where safe_zero expects it."""
    check_deepspeed_supported()
    for binding in bindings:
        module = importlib.import_module(binding.module)
        found = getattr(module, binding.name, None)
        if found is not binding.stock:
            raise DeepSpeedDriftError(
                f"{binding.where()} is {found!r}, expected DeepSpeed's {binding.stock.__qualname__}. "
                f"This DeepSpeed ({deepspeed.__version__}) has drifted from what safe_zero supports "
                f"({SUPPORTED_DEEPSPEED}); install a supported release.")


def verify_overrides(classes: tuple[type, ...] | None = None) -> None:
    """Raise :class:`DeepSpeedDriftError` if a DeepSpeed method a fix overrides is gone or takes other arguments.

    Checks every ``@overrides`` method of the mixins of ``classes`` (default: every safe class) against
    the DeepSpeed class it extends.
    """
    patching.verify_overrides(wrappers.OVERRIDING if classes is None else classes)


#: DeepSpeed's own ``initialize``, and its signature (safe_zero's routes present it as theirs).
STOCK_INITIALIZE = deepspeed.initialize
STOCK_SIGNATURE = inspect.signature(STOCK_INITIALIZE)


@contextlib.contextmanager
def injected(session: Session, bindings: tuple[Binding, ...] = BINDINGS) -> Iterator[None]:
    """Bind the safe subclasses and make ``session`` current; restore what was there before on exit."""
    with contextlib.ExitStack() as stack:
        for binding in bindings:
            stack.enter_context(swapped(importlib.import_module(binding.module), binding.name, binding.safe))
        stack.enter_context(made_current(session))
        yield


def check_precision(config: Mapping[str, Any] | None) -> None:
    """fp16 on a CPU DeepSpeed runs no fp16 on fails deep inside initialize; say what to use instead.

    DeepSpeed's own test decides (``is_fp16_supported``: the CPU accelerator reports fp16 where oneDNN has fp16
    kernels), so safe_zero refuses exactly where stock DeepSpeed would.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if config and (config.get("fp16") or {}).get("enabled") and accelerator.device_name() == "cpu" \
            and not accelerator.is_fp16_supported():
        raise UnsupportedPrecisionError(
            'fp16 is not supported by DeepSpeed\'s CPU accelerator. Use bf16 instead: replace "fp16" with '
            '"bf16": {"enabled": true} in the DeepSpeed config (Lightning: precision="bf16-mixed").')


def unreachable_modes(config: Mapping[str, Any] | None) -> list[str]:
    """The modes ``config`` selects whose classes the injection cannot reach (DeepSpeed binds them at import)."""
    if not config:
        return []
    zero = config.get("zero_optimization") or {}
    offload_optimizer = zero.get("offload_optimizer") or {}
    modes = []
    if zero.get("zenflow"):
        modes.append("ZenFlow (zero_optimization.zenflow)")
    if offload_optimizer.get("super_offload"):
        modes.append("SuperOffload (zero_optimization.offload_optimizer.super_offload)")
    if (config.get("compile") or {}).get("deepcompile"):
        modes.append("DeepCompile (compile.deepcompile)")
    return modes


def fixes_the_model_needs(model: Any, config: Mapping[str, Any] | None, session: Session,
                          leaf_blocks: Mapping[str, Any] = {}) -> list[str]:
    """What safe_zero would have to fix in ``model`` under ``config`` on this DeepSpeed, as far as it shows before
    training: zero-element trainable parameters where a fix for them is on, MoE blocks ZeRO-3 must gather whole,
    and grouped_mm weights to keep aligned where DeepSpeed's own ``parameter_alignment`` (which safe_zero sets in
    the config) does not pad. A parameter autograd leaves without a gradient, or that only some ranks use, only
    shows in backward; stock fails on it in these modes as it does elsewhere.
    """
    stage = zero_stage(config)
    needs = []
    empty_fix = zero3_zero_element_params.FIX if stage == 3 else zero_element_groups.FIX
    if isinstance(model, torch.nn.Module) and session.uses(empty_fix):
        empty = [name for name, p in model.named_parameters()
                 if p.requires_grad and getattr(p, "ds_numel", p.numel()) == 0]
        if empty:
            needs.append(f"zero-element parameter(s) {', '.join(empty[:3])}{' ...' if len(empty) > 3 else ''}")
    if leaf_blocks:
        needs.append(f"MoE block(s) {', '.join(list(leaf_blocks)[:3])} gathered whole under ZeRO-3")
    plan = alignment.plan_for(session)
    bf16_optimizer = stage == 1 and ((config or {}).get("bf16") or {}).get("enabled") and \
        ((config or {}).get("data_types") or {}).get("grad_accum_dtype") == "fp32"
    padded_by_deepspeed = stage in (1, 2) and not bf16_optimizer and DEEPSPEED_PADS_PARAMETERS
    if plan.active and not padded_by_deepspeed:
        named = ", ".join(list(plan.params)[:3]) or "(alignment: true)"
        needs.append(f"16-byte alignment of grouped_mm weight(s) {named}")
    return needs


def check_reachable(config: Mapping[str, Any] | None, model: Any = None, session: Session | None = None,
                    leaf_blocks: Mapping[str, Any] = {}) -> list[str]:
    """Decide what to do with a mode the injection cannot reach: the modes to run stock when ``model``
    needs no fix (never worse than stock), an :class:`UnreachableModeError` when it needs one."""
    modes = unreachable_modes(config)
    needs = fixes_the_model_needs(model, config, session or Session(), leaf_blocks) if modes else []
    if needs:
        raise UnreachableModeError(
            f"safe_zero cannot inject its fixes into {', '.join(modes)}: DeepSpeed binds those classes at "
            f"import time, and this model needs {'; '.join(needs)}. Turn the mode off to train with safe_zero; "
            "with the mode on, stock DeepSpeed would train this model without those fixes.")
    return modes


_STOCK_WRAPPERS = (FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer, DeepSpeedZeroOptimizer,
                   DeepSpeedZeroOptimizer_Stage3)


def verify_engine(engine: Any) -> None:
    """Raise if the engine's optimizer wrapper is a stock DeepSpeed class rather than safe_zero's."""
    optimizer = getattr(engine, "optimizer", None)
    if isinstance(optimizer, _STOCK_WRAPPERS) and not isinstance(optimizer, wrappers.SAFE_CLASSES):
        raise InjectionError(
            f"deepspeed.initialize built a stock {type(optimizer).__qualname__} although safe_zero was asked for. "
            "A DeepSpeed mode bypassed the injection; please report this configuration.")


def _log_report(session: Session) -> None:
    from deepspeed.utils import log_dist

    # WARNING, not INFO: DeepSpeed and HF Trainer raise DeepSpeed's log level, and a forgotten opt-in must show.
    log_dist(f"safe_zero: {session.describe()}", ranks=[0], level=logging.WARNING)


def initialize(*args: Any, **kwargs: Any) -> tuple:
    """``deepspeed.initialize`` with safe_zero's corrected classes; same arguments, same return tuple.

    The ``"safe_zero"`` block of the DeepSpeed config (see :class:`safe_zero.SafeZeroOptions`)
    selects fixes. The engine keeps the session as ``engine.safe_zero_session``.
    """
    return initialize_calling(STOCK_INITIALIZE, *args, **kwargs)


def initialize_calling(inner: Callable[..., tuple], *args: Any, **kwargs: Any) -> tuple:
    """:func:`initialize` that calls ``inner`` (DeepSpeed's ``initialize``, or a wrapper around it) inside the
    injection; what ``inner`` returns is checked like DeepSpeed's own result."""
    bound = STOCK_SIGNATURE.bind(*args, **kwargs)
    arguments = bound.arguments
    config = resolve_config(arguments)
    session = Session(options=SafeZeroOptions.from_config(config))
    check_precision(config)
    leaf_blocks = blocks_to_gather_whole(arguments.get("model"), config, session)
    adjusted = alignment.prepare_config(arguments.get("model"), config, session)
    stock_modes = check_reachable(config, arguments.get("model"), session, leaf_blocks)
    if adjusted is not None:  # grouped_mm weights: DeepSpeed's own padding switched on
        pass_config(bound, adjusted)
        args, kwargs = bound.args, bound.kwargs
    if stock_modes:  # nothing for the injection to fix: the mode runs as stock DeepSpeed runs it
        from deepspeed.utils import log_dist

        padded = " (with zero_optimization.parameter_alignment on)" if adjusted is not None else ""
        log_dist(f"safe_zero: no fix applies to this model under {', '.join(stock_modes)}; running stock "
                 f"DeepSpeed{padded}", ranks=[0], level=logging.WARNING)
        result = inner(*args, **kwargs)
        result[0].safe_zero_session = session
        make_joinable(result[0], session)
        return result
    make_leaves(leaf_blocks, session)
    with injected(session):
        result = inner(*args, **kwargs)
    engine = result[0]
    verify_engine(engine)
    engine.safe_zero_session = session
    make_joinable(engine, session)
    _log_report(session)
    return result


initialize.__signature__ = STOCK_SIGNATURE  # type: ignore[attr-defined]  # read by inspect.signature; untyped on functions


def _installed_initialize(*args: Any, **kwargs: Any) -> tuple:
    return initialize(*args, **kwargs)


#: The restores of what :func:`install` rebound, by name; :func:`uninstall` runs them.
_INSTALLED: dict[str, tuple[Any, Any, Callable[[], None]]] = {}


def install() -> None:
    """Route every ``deepspeed.initialize`` in this process through :func:`initialize`, and
    ``deepspeed.zero.Init`` to :class:`safe_zero.Init`. Idempotent."""
    with patching.LOCK:
        if deepspeed.initialize is not _installed_initialize:
            _INSTALLED["initialize"] = (deepspeed, _installed_initialize,
                                        swap(deepspeed, "initialize", _installed_initialize))
        if deepspeed.zero.Init is STOCK_INIT:  # a class someone else put there stays (uninstall could not restore it)
            _INSTALLED["Init"] = (deepspeed.zero, Init, swap(deepspeed.zero, "Init", Init))


def uninstall() -> None:
    """Put back what ``deepspeed.initialize`` and ``deepspeed.zero.Init`` were before :func:`install`
    (where nobody rebound them since). Idempotent."""
    with patching.LOCK:
        for name, (owner, ours, restore) in list(_INSTALLED.items()):
            del _INSTALLED[name]
            if getattr(owner, name) is ours:
                restore()


def is_installed() -> bool:
    return deepspeed.initialize is _installed_initialize
