"""``Accelerator.join_uneven_inputs`` for safe_zero's engines: Accelerate joins DDP models only (under DeepSpeed it
warns and does nothing); the engine safe_zero builds is a ``Joinable`` (``safe_zero/uneven_inputs.py``), so there it
takes Accelerate's own DDP path: ``even_batches`` overridden on the prepared loaders, and torch's ``Join``."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

from accelerate import Accelerator
from accelerate.utils import DistributedType

from safe_zero.patching import LOCK
from safe_zero.uneven_inputs import JoinsUnevenInputs

STOCK_JOIN_UNEVEN_INPUTS = Accelerator.join_uneven_inputs


def joins_engines(accelerator: Any, joinables: list[Any]) -> bool:
    """Whether ``joinables`` are safe_zero engines of a distributed DeepSpeed run."""
    return (accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.use_distributed
            and bool(joinables) and all(isinstance(j, JoinsUnevenInputs) for j in joinables))


@functools.cache
def _multi_device(klass: type) -> type:
    # Accelerate 1.10+ asks ``multi_device``; before (no such property), whether ``distributed_type`` is multi-device
    answer = ({"multi_device": property(lambda self: True)} if hasattr(klass, "multi_device")
              else {"distributed_type": property(lambda self: DistributedType.MULTI_GPU)})
    return type(klass.__name__, (klass,), {**answer, "__module__": klass.__module__})


@contextlib.contextmanager
def join_uneven_inputs(self: Any, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
    """Accelerate's ``join_uneven_inputs``; for safe_zero's engines under DeepSpeed, its multi-device path."""
    if not joins_engines(self, joinables):
        with STOCK_JOIN_UNEVEN_INPUTS(self, joinables, even_batches=even_batches):
            yield
        return
    with contextlib.ExitStack() as stack:
        klass: type = type(self)
        self.__class__ = _multi_device(klass)  # what Accelerate asks, once, before it opens the Join
        try:
            stack.enter_context(STOCK_JOIN_UNEVEN_INPUTS(self, joinables, even_batches=even_batches))
        finally:
            self.__class__ = klass
        yield


def install_join_uneven_inputs() -> None:
    """Bind :func:`join_uneven_inputs` as ``Accelerator.join_uneven_inputs`` (idempotent; on importing
    ``safe_zero.accelerate``). It differs from Accelerate's only for safe_zero's engines."""
    with LOCK:
        Accelerator.join_uneven_inputs = join_uneven_inputs


def uninstall_join_uneven_inputs() -> None:
    """Accelerate's own ``join_uneven_inputs`` back. Idempotent."""
    with LOCK:
        Accelerator.join_uneven_inputs = STOCK_JOIN_UNEVEN_INPUTS
