"""Lightning integration: ``Trainer(strategy="safe_deepspeed_stage_3")`` and the same for Fabric.

After ``import safe_zero``, every DeepSpeed strategy name Lightning registers has a ``safe_`` twin
with the same meaning (``safe_deepspeed``, ``safe_deepspeed_stage_1``, ``safe_deepspeed_stage_2``,
``safe_deepspeed_stage_2_offload``, ``safe_deepspeed_stage_3``, ``safe_deepspeed_stage_3_offload``,
``safe_deepspeed_stage_3_offload_nvme``, and for Fabric also ``safe_deepspeed_stage_1_offload``), in
the registries of ``lightning.pytorch``, ``lightning.fabric`` and, when installed, standalone
``pytorch_lightning`` and ``lightning_fabric``.

Classes (importing them imports Lightning):
    SafeDeepSpeedStrategy         ``lightning.pytorch``'s ``DeepSpeedStrategy`` through safe_zero.
    SafeFabricDeepSpeedStrategy   ``lightning.fabric``'s ``DeepSpeedStrategy`` through safe_zero.
The standalone packages' twins: ``safe_zero.lightning.pytorch_lightning.SafeDeepSpeedStrategy`` and
``safe_zero.lightning.lightning_fabric.SafeFabricDeepSpeedStrategy``.

Functions:
    convert_zero_checkpoint_to_fp32_state_dict   Lightning's converter, zero-element parameters included.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SafeDeepSpeedStrategy": "safe_zero.lightning.pytorch",
    "SafeFabricDeepSpeedStrategy": "safe_zero.lightning.fabric",
    "SAFE_PREFIX": "safe_zero.lightning._common",
    "PrecisionFallbackWarning": "safe_zero.lightning._common",
    "SafeLightningError": "safe_zero.lightning._common",
    "convert_zero_checkpoint_to_fp32_state_dict": "safe_zero.lightning.checkpoint",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that `import safe_zero` (which imports this package for the registration hook) imports
    # neither Lightning nor the strategy helpers.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SAFE_PREFIX", "PrecisionFallbackWarning", "SafeDeepSpeedStrategy", "SafeFabricDeepSpeedStrategy",
           "SafeLightningError", "convert_zero_checkpoint_to_fp32_state_dict"]
