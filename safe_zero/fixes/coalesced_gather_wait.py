"""A blocking ZeRO-3 all-gather that returns before its gathers landed (DeepSpeed before 0.19.8, CPU/gloo).

``zero.Init._allgather_params_coalesced`` is the blocking gather behind ``GatheredParameters``
of several parameters, the 16-bit consolidated state dict and the gather of persistent
parameters after every optimizer step. It launches one asynchronous all-gather per parameter
and waits only on the last handle, relying on the accelerator's ``synchronize()`` for the
rest. That holds on CUDA (one stream orders the collectives, and ``synchronize`` runs), but
the CPU accelerator skips ``synchronize`` and gloo's handles complete independently: the call
can return while earlier parameters still hold uninitialized memory. Seen here as an ``inf``
loss one step after the persistent-parameter gather at world size 2. DeepSpeed 0.19.8 waits on
every handle (read from the 0.18.0, 0.18.9, 0.19.0, 0.19.6, 0.19.7 and 0.19.8 sources).

The fix hands that method one parameter at a time where the accelerator skips the
synchronize, so the one handle it waits on is the only one. It issues the same all-gathers
(the stock method already issues one per parameter), only not overlapped.

It reaches the parameters partitioned by the ``zero.Init`` that ``safe_zero.initialize``
builds for a model and by :class:`safe_zero.Init` (``deepspeed.zero.Init`` after
``safe_zero.install()``); a model partitioned earlier by a stock ``deepspeed.zero.Init`` keeps
DeepSpeed's gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from deepspeed.accelerator import get_accelerator
from packaging.specifiers import SpecifierSet

from safe_zero.fix import Fix
from safe_zero.patching import overrides
from safe_zero.session import session_for, state_of

if TYPE_CHECKING:
    # mypy reads the mixin as the DeepSpeed class it is put before (untyped: its attributes are Any); at run time a
    # mixin subclasses nothing (docs/developing.md, "A new fix").
    from deepspeed.runtime.zero.partition_parameters import Init as _ZeroInit
else:
    _ZeroInit = object

FIX = Fix(
    name="coalesced_gather_wait",
    summary="complete every all-gather of a blocking ZeRO-3 coalesced gather before it returns (CPU accelerator)",
    needed_on=SpecifierSet("<0.19.8"),
    no_probe="its defect needs two ranks; the probes run one",
)


class WaitEveryCoalescedGather(_ZeroInit):
    """Mixin for ``zero.Init``: its blocking coalesced gather, one parameter per call where handles are unordered."""

    @overrides
    def _allgather_params_coalesced(self, param_list: list[torch.nn.Parameter], hierarchy: int = 0,
                                    quantize: bool = False) -> None:
        # resolves_data_dependency(): the accelerator skips the synchronize that would complete the rest.
        if len(param_list) > 1 and get_accelerator().resolves_data_dependency() and session_for(self).uses(FIX):
            state = state_of(self)
            if not state.coalesced_gather:  # told once per zero.Init
                state.coalesced_gather = True
                state.session.engaged(FIX, "blocking coalesced all-gathers completed one parameter at a time")
            for param in param_list:
                super()._allgather_params_coalesced([param], hierarchy, quantize)
            return None
        return super()._allgather_params_coalesced(param_list, hierarchy, quantize)


__all__ = ["FIX", "WaitEveryCoalescedGather"]
