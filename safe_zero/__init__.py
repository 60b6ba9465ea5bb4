"""safe_zero: DeepSpeed ZeRO for models with zero-sized, gradient-less and grouped_mm parameters.

Public API:
    initialize(...)        drop-in for ``deepspeed.initialize`` (same arguments, same tuple).
    install()/uninstall()  route every ``deepspeed.initialize`` in the process through safe_zero.
    SafeZeroOptions        the ``"safe_zero"`` block of a DeepSpeed config.
    FIXES                  the defects safe_zero corrects, by name.
    Init(...)              drop-in for ``deepspeed.zero.Init`` with the ZeRO-3 zero-element fixes.
    get_fp32_state_dict_from_zero_checkpoint(...)  DeepSpeed's zero_to_fp32 API, zero-element params included.
    mark_grouped_mm(...)   declare a custom layer/parameter that feeds grouped_mm (kept 16-byte aligned).
    grouped_mm_parameters  the parameters of a model that need 16-byte alignment.
"""

from safe_zero._compat import SUPPORTED_DEEPSPEED
from safe_zero.alignment import (
    grouped_mm_parameters,
    is_aligned,
    mark_grouped_mm,
)
from safe_zero.errors import (
    AlignmentError,
    AlignmentWarning,
    DeepSpeedDriftError,
    InjectionError,
    SafeZeroConfigError,
    SafeZeroError,
    UnevenInputsError,
    UnreachableModeError,
    UnsupportedDeepSpeedError,
    UnsupportedPrecisionError,
)
from safe_zero.fixes import FIXES, Fix
from safe_zero.injection import (
    initialize,
    install,
    is_installed,
    uninstall,
    verify_bindings,
    verify_overrides,
)
from safe_zero.options import SafeZeroOptions
from safe_zero.session import Session
from safe_zero.fixes.zero3_zero_element_params import get_fp32_state_dict_from_zero_checkpoint
from safe_zero.zero_init import Init

__version__ = "0.1.0"

verify_bindings()
verify_overrides()

# `safe_deepspeed*` strategy names for Lightning, registered once Lightning's strategies are imported
# (Lightning itself is not imported here; nothing happens where it is not installed).
from safe_zero.lightning._registration import register_when_imported as _register_lightning_strategies  # noqa: E402

_register_lightning_strategies()

__all__ = [
    "AlignmentError",
    "AlignmentWarning",
    "FIXES",
    "Init",
    "SUPPORTED_DEEPSPEED",
    "DeepSpeedDriftError",
    "Fix",
    "InjectionError",
    "SafeZeroConfigError",
    "SafeZeroError",
    "SafeZeroOptions",
    "Session",
    "UnevenInputsError",
    "UnreachableModeError",
    "UnsupportedPrecisionError",
    "UnsupportedDeepSpeedError",
    "grouped_mm_parameters",
    "initialize",
    "install",
    "is_aligned",
    "is_installed",
    "mark_grouped_mm",
    "uninstall",
    "verify_bindings",
    "verify_overrides",
    "get_fp32_state_dict_from_zero_checkpoint",
]
