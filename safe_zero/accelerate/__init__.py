"""Accelerate and HF Trainer integration: the engine ``Accelerator.prepare`` builds goes through safe_zero.

Three ways in (see ``examples/accelerate/README.md``):

* ``Accelerator(deepspeed_plugin=SafeDeepSpeedPlugin(...))``: Accelerate's ``DeepSpeedPlugin``
  with the same fields and the same ``accelerate launch`` environment, opted in.
* HF Trainer (and TRL's trainers): ``Trainer(..., callbacks=[SafeZeroCallback()])`` (needs
  ``transformers``). For a quantized model whose quantized weights cannot learn (FP-Quant without
  master weights), :func:`allow_trainer_fine_tuning` lifts the Trainer's refusal to fine-tune the rest.
* Config file: a DeepSpeed JSON with a top-level ``"safe_zero"`` block, plus ``import
  safe_zero.accelerate`` in the script. Importing this package binds
  :func:`install_on_request`: ``deepspeed.initialize`` calls whose config carries the block go
  through :func:`safe_zero.initialize`; calls without it stay exactly stock (with a rank-0 warning
  that safe_zero did not run). A script that cannot be edited can be launched as
  ``accelerate launch --config_file <yaml> -m safe_zero.accelerate train.py [args]``.

This package holds no fix: grouped_mm alignment and every fix are decided inside
``safe_zero.initialize`` from the model and the config's ``"safe_zero"`` block.
"""

from __future__ import annotations

from typing import Any

from safe_zero.versions import require

require("accelerate", "safe_zero.accelerate")

from safe_zero.accelerate.plugin import SafeDeepSpeedPlugin  # noqa: E402
from safe_zero.accelerate.routing import (  # noqa: E402
    WorldSizeMismatchError,
    check_world_size,
    cpu_distributed_state,
    install_on_request,
    is_routed,
    requests_safe_zero,
    session_of,
    uninstall_on_request,
)

from safe_zero.accelerate.uneven_inputs import (  # noqa: E402
    install_join_uneven_inputs,
    uninstall_join_uneven_inputs,
)

install_on_request()
install_join_uneven_inputs()

__all__ = [
    "SafeDeepSpeedPlugin",
    "SafeZeroCallback",
    "allow_trainer_fine_tuning",
    "WorldSizeMismatchError",
    "check_world_size",
    "cpu_distributed_state",
    "install_join_uneven_inputs",
    "install_on_request",
    "is_routed",
    "requests_safe_zero",
    "session_of",
    "uninstall_join_uneven_inputs",
    "uninstall_on_request",
]


def __getattr__(name: str) -> Any:
    # The Trainer glue needs transformers; plain Accelerate users do not.
    if name in ("SafeZeroCallback", "allow_trainer_fine_tuning"):
        from safe_zero.accelerate import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
