"""``SafeDeepSpeedPlugin``: Accelerate's ``DeepSpeedPlugin`` whose ``Accelerator.prepare`` goes through safe_zero."""

from __future__ import annotations

import dataclasses
from typing import Any

from accelerate.utils import DeepSpeedPlugin

from safe_zero.accelerate.routing import (
    check_routed,
    check_world_size,
    cpu_distributed_state,
    install_on_request,
    opt_in,
)
from safe_zero.errors import UnreachableModeError
from safe_zero.options import CONFIG_KEY

#: Whether this Accelerate still has MS-AMP: 1.16 removed it, and with it the ``enable_msamp`` field.
ACCELERATE_HAS_MSAMP: bool = "enable_msamp" in {field.name for field in dataclasses.fields(DeepSpeedPlugin)}


class SafeDeepSpeedPlugin(DeepSpeedPlugin):
    """Accelerate's ``DeepSpeedPlugin`` (same fields, same ``ACCELERATE_*`` environment) that opts in to safe_zero.

    Pass it to ``Accelerator(deepspeed_plugin=SafeDeepSpeedPlugin(...))`` exactly where a
    ``DeepSpeedPlugin`` goes; every ``accelerate launch`` setting (config file, ZeRO stage,
    offload, gradient accumulation and clipping, mixed precision) applies unchanged.
    ``Accelerator.prepare`` then builds the engine with :func:`safe_zero.initialize`.

    What it does on top of ``DeepSpeedPlugin``:

    * adds ``"safe_zero": {}`` to its DeepSpeed config unless the config (e.g. the JSON named by
      ``deepspeed_config_file``) already has a ``"safe_zero"`` block, which is validated here and
      selects the fixes (see :class:`safe_zero.SafeZeroOptions`); its ``"auto"`` settings are
      dropped (they are the defaults), because Accelerate fails on ``"auto"`` values it does not know;
    * binds :func:`safe_zero.accelerate.install_on_request` so that config goes through safe_zero;
    * on a host without an accelerator, when a launcher started the process and Accelerate's state
      does not exist yet, creates it with DeepSpeed's CPU backend (gloo) so Accelerate and
      DeepSpeed count the same processes (:func:`safe_zero.accelerate.cpu_distributed_state`);
      if the state already counts differently, the ``Accelerator`` raises an error saying what to pass;
    * refuses MS-AMP (``enable_msamp``, Accelerate < 1.16, which removed MS-AMP), which Accelerate
      initializes through its own ``msamp.deepspeed.initialize`` that safe_zero cannot reach;
    * right before Accelerate calls ``deepspeed.initialize``, checks that the call will go through
      safe_zero, and raises otherwise.

    grouped_mm alignment is decided by ``safe_zero.initialize`` from the model (``"alignment":
    "auto"``), so no plugin field is needed for it.
    """

    def __post_init__(self) -> None:
        cpu_distributed_state()
        super().__post_init__()
        if ACCELERATE_HAS_MSAMP and self.enable_msamp:
            raise UnreachableModeError(
                "safe_zero cannot reach MS-AMP (ACCELERATE_FP8_BACKEND=MSAMP / enable_msamp): Accelerate initializes "
                "it through msamp.deepspeed.initialize. Use a stock DeepSpeedPlugin to run MS-AMP without safe_zero.")
        opt_in(self.deepspeed_config)  # a malformed block fails here, not at prepare
        install_on_request()

    def select(self, _from_accelerator_state: bool = False) -> None:
        # The Accelerator calls this right after it has built its process state.
        super().select(_from_accelerator_state=_from_accelerator_state)
        check_world_size(
            "Something created Accelerate's state before this SafeDeepSpeedPlugin: construct the plugin first, or "
            "create accelerate.PartialState(backend=\"gloo\") yourself before anything else touches Accelerate.")

    def set_moe_leaf_modules(self, model: Any) -> None:
        # The last plugin call in Accelerator._prepare_deepspeed before deepspeed.initialize.
        super().set_moe_leaf_modules(model)
        self.deepspeed_config.setdefault(CONFIG_KEY, {})
        check_routed(type(self).__name__)
