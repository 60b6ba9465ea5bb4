"""Route the ``deepspeed.initialize`` calls that ask for safe_zero through :func:`safe_zero.initialize`.

Accelerate (and HF Trainer through it) reads ``deepspeed.initialize`` at call time, at the top
of ``Accelerator._prepare_deepspeed``, before any plugin method sees the model. So the hook
is a dispatcher bound to ``deepspeed.initialize``: a call whose DeepSpeed config carries a
top-level ``"safe_zero"`` block goes through safe_zero; every other call goes to the function
that was bound before with the same arguments, so it is exactly what it was without safe_zero.
A wrapper someone else put there first (a profiler, a test mock) is called either way; on the
safe_zero route DeepSpeed's own ``initialize`` below it runs with safe_zero's classes
(:func:`safe_zero.chaining.initialize_through`).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Mapping

import deepspeed

from safe_zero import chaining
from safe_zero.errors import InjectionError, WorldSizeMismatchError  # noqa: F401  (re-exported)
from safe_zero.injection import STOCK_INITIALIZE, STOCK_SIGNATURE
from safe_zero.patching import LOCK, swap
from safe_zero.options import CONFIG_KEY, SafeZeroOptions, resolve_config
from safe_zero.session import Session


def requests_safe_zero(config: Mapping[str, Any] | None) -> bool:
    """Whether a DeepSpeed config asks for safe_zero: it has a top-level ``"safe_zero"`` block (``{}`` is enough)."""
    return isinstance(config, Mapping) and CONFIG_KEY in config


def opt_in(config: dict[str, Any]) -> None:
    """Make ``config`` ask for safe_zero: add ``"safe_zero": {}`` if absent, validate the block, drop its ``"auto"``s.

    Accelerate and HF Trainer treat every ``"auto"`` string in a DeepSpeed config as a value they
    must fill and raise on the ones they do not know. ``"auto"`` is the default of every
    safe_zero setting, so leaving it out means the same.
    """
    SafeZeroOptions.from_config(config)
    block = dict(config.get(CONFIG_KEY) or {})
    if isinstance(block.get("fixes"), Mapping):
        block["fixes"] = {name: setting for name, setting in block["fixes"].items() if setting != "auto"}
    config[CONFIG_KEY] = {key: value for key, value in block.items() if value != "auto"}


_warned_stock = False


def _warn_stock_once() -> None:
    global _warned_stock
    if _warned_stock:
        return
    _warned_stock = True
    from deepspeed.utils import log_dist

    log_dist(f'safe_zero: this DeepSpeed config has no "{CONFIG_KEY}" block, so deepspeed.initialize runs stock '
             f'DeepSpeed without safe_zero\'s fixes. Add "{CONFIG_KEY}": {{}} to the config to opt in.',
             ranks=[0], level=logging.WARNING)


# The session of each module an engine was built for here, so HF Trainer callbacks (which see the
# module, not the engine) can report and verify it.
_SESSIONS: "weakref.WeakKeyDictionary[Any, Session]" = weakref.WeakKeyDictionary()


def session_of(module: Any) -> Session | None:
    """The safe_zero session of the engine the dispatcher built around ``module``, if it built one."""
    return _SESSIONS.get(module)


#: What ``deepspeed.initialize`` was when the dispatcher was bound: DeepSpeed's own, or someone's wrapper.
_outer: Any = STOCK_INITIALIZE
#: Puts that back (set while the dispatcher is bound).
_restore: Any = None


def _routed_initialize(*args: Any, **kwargs: Any) -> tuple:
    outer = _outer
    config = resolve_config(STOCK_SIGNATURE.bind(*args, **kwargs).arguments)
    if not requests_safe_zero(config):
        _warn_stock_once()
        return outer(*args, **kwargs)
    check_world_size()
    result = chaining.initialize_through(outer, *args, **kwargs)
    engine = result[0]
    _SESSIONS[engine.module] = engine.safe_zero_session
    return result


_routed_initialize.__signature__ = STOCK_SIGNATURE  # type: ignore[attr-defined]  # read by inspect.signature; untyped on functions
_routed_initialize.__doc__ = "deepspeed.initialize, routed through safe_zero when the config has a safe_zero block."
chaining.register_route(_routed_initialize)


def install_on_request() -> None:
    """Bind the dispatcher to ``deepspeed.initialize``: configs with a ``"safe_zero"`` block go through safe_zero.

    Idempotent. Leaves ``safe_zero.install()`` (which routes every call) in place. A function
    someone else bound to ``deepspeed.initialize`` before stays in the chain: the dispatcher calls it,
    and :func:`uninstall_on_request` puts it back.
    """
    global _outer, _restore
    with LOCK:
        current = deepspeed.initialize
        if chaining.routes_through_safe_zero(current):
            return
        _outer = current
        _restore = swap(deepspeed, "initialize", _routed_initialize)


def uninstall_on_request() -> None:
    """Unbind the dispatcher, restoring what ``deepspeed.initialize`` was before it. Idempotent."""
    global _outer, _restore
    with LOCK:
        if deepspeed.initialize is _routed_initialize and _restore is not None:
            _restore()
            _outer, _restore = STOCK_INITIALIZE, None


def is_routed() -> bool:
    """Whether a ``deepspeed.initialize`` call that asks for safe_zero goes through it right now.

    Also true for a ``functools.wraps`` wrapper someone put around safe_zero's routing afterwards.
    """
    return chaining.routes_through_safe_zero(deepspeed.initialize)


def check_routed(where: str) -> None:
    """Raise :class:`safe_zero.InjectionError` if ``deepspeed.initialize`` would run stock (``where``: the caller)."""
    if not is_routed():
        raise InjectionError(
            f"{where} asked for safe_zero, but deepspeed.initialize is {deepspeed.initialize!r}, not safe_zero's "
            "(was safe_zero.uninstall() or safe_zero.accelerate.uninstall_on_request() called, or did something "
            "else replace it?). Call safe_zero.accelerate.install_on_request() before Accelerator.prepare / "
            "Trainer.train, or this run would be stock DeepSpeed.")


# ----------------------------------------------------------------------------------------------
# CPU runs: Accelerate and DeepSpeed must count the same processes.


def _launched_on_cpu() -> bool:
    """A launcher started this process (``LOCAL_RANK`` set) and DeepSpeed runs on its CPU accelerator."""
    if int(os.environ.get("LOCAL_RANK", -1)) == -1:
        return False
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def cpu_distributed_state() -> bool:
    """Create Accelerate's process state with DeepSpeed's CPU communication backend (gloo), once.

    On a host without an accelerator, Accelerate picks no backend for a DeepSpeed run and counts
    one process while DeepSpeed's process group has all of them; DeepSpeed then fails its batch
    size check. Call this before anything creates Accelerate's state (``SafeDeepSpeedPlugin``
    does it for you). Does nothing when the state already exists, when no launcher started the
    process, or when DeepSpeed runs on an accelerator. For a custom process-group timeout, create
    ``PartialState(backend="gloo", timeout=...)`` yourself.

    Returns whether Accelerate's process state exists now. HF Trainer builds its own state in
    ``TrainingArguments`` unless told to use the configured one, so on any host::

        configured = safe_zero.accelerate.cpu_distributed_state()
        args = TrainingArguments(..., accelerator_config={"use_configured_state": configured})
    """
    from accelerate import PartialState
    from deepspeed.accelerator import get_accelerator

    if PartialState._shared_state or not _launched_on_cpu():
        return bool(PartialState._shared_state)

    # Accelerate takes the DeepSpeed route (deepspeed.comm.init_distributed) only when this is set;
    # an Accelerator given a DeepSpeed plugin sets it too.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend=get_accelerator().communication_backend_name())
    return True


def check_world_size(how_to_fix: str | None = None) -> None:
    """Raise :class:`WorldSizeMismatchError` when Accelerate and torch.distributed disagree on the world size."""
    import torch.distributed as dist
    from accelerate import PartialState

    if not PartialState._shared_state or not (dist.is_available() and dist.is_initialized()):
        return
    counted, world = PartialState().num_processes, dist.get_world_size()
    if counted != world:
        raise WorldSizeMismatchError(
            f"Accelerate counts {counted} process(es) but the DeepSpeed process group has {world}: on a host "
            "without an accelerator Accelerate picks no backend. " + (how_to_fix or (
                "Call safe_zero.accelerate.cpu_distributed_state() (or accelerate.PartialState(backend=\"gloo\")) "
                "before creating the Accelerator, or pass deepspeed_plugin=SafeDeepSpeedPlugin(...), which does it.")))
