"""One module per DeepSpeed defect. Each declares a :class:`Fix` and the mixins that correct it.

``FIXES`` lists them by the name used in the ``"safe_zero": {"fixes": {...}}`` config block.
"""

from __future__ import annotations

from safe_zero.fixes import (coalesced_gather_wait, flat_buffer_autograd, gradless_params, grouped_mm_alignment,
                              zero3_zero_element_params, zero_element_groups)
from safe_zero.fix import Fix  # noqa: F401  (re-exported)

FIXES: dict[str, Fix] = {
    module.FIX.name: module.FIX
    for module in (zero_element_groups, gradless_params, grouped_mm_alignment, zero3_zero_element_params,
                   flat_buffer_autograd, coalesced_gather_wait)
}

__all__ = ["FIXES", "Fix"]
