"""One module per DeepSpeed defect. Each declares a :class:`Fix` and the mixins that correct it.

``FIXES`` lists them by the name used in the ``"safe_zero": {"fixes": {...}}`` config block; it is the registry of
:mod:`safe_zero.fix`, which the options and the session read.
"""

from __future__ import annotations

from safe_zero.fix import Fix, register
from safe_zero.fixes import (coalesced_gather_wait, flat_buffer_autograd, gradless_params, grouped_mm_alignment,
                              zero3_zero_element_params, zero_element_groups)

FIXES: dict[str, Fix] = register(zero_element_groups.FIX, gradless_params.FIX, grouped_mm_alignment.FIX,
                                 zero3_zero_element_params.FIX, flat_buffer_autograd.FIX, coalesced_gather_wait.FIX)

__all__ = ["FIXES", "Fix"]
