"""``safe_zero.Init``: ``deepspeed.zero.Init`` with safe_zero's ZeRO-3 fixes for the parameters it partitions.

Under ``deepspeed.zero.Init`` parameters are partitioned as each submodule is built, before
``safe_zero.initialize`` ever sees the model, and the construction itself may gather them
(``GatheredParameters`` in weight initialization or checkpoint loading). ``safe_zero.Init``
takes the same arguments and does the same, and in addition

- keeps zero-element parameters out of every gather it issues (see
  :mod:`safe_zero.fixes.zero3_zero_element_params`), and
- builds its weight quantizer (``zero_quantized_weights`` /
  ``zero_quantized_nontrainable_weights``) with the empty-partition guard, and
- completes every all-gather of a blocking coalesced gather before returning (see
  :mod:`safe_zero.fixes.coalesced_gather_wait`).

The fixes it applies follow the ``"safe_zero"`` block of the config passed as
``config_dict_or_path`` (or ``config``), like :func:`safe_zero.initialize`. ``safe_zero.install()``
makes ``deepspeed.zero.Init`` this class (``uninstall()`` restores DeepSpeed's); ``safe_zero.initialize``
binds it where ZeRO-3 partitions a model that no ``zero.Init`` built.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.partition_parameters import Init as STOCK_INIT

from safe_zero.fixes.coalesced_gather_wait import WaitEveryCoalescedGather
from safe_zero.fixes.zero3_zero_element_params import FIX, SafeCUDAQuantizer, ZeroElements, adopt, is_zero_element
from safe_zero.options import SafeZeroOptions, resolve_config
from safe_zero.patching import overrides, swapped
from safe_zero.session import Session, current_session, made_current, state_of

_STOCK_SIGNATURE = inspect.signature(STOCK_INIT.__init__)


class Init(WaitEveryCoalescedGather, STOCK_INIT):
    """Drop-in for ``deepspeed.zero.Init`` (same arguments, also usable as a context manager).

    The one safe ``zero.Init``: the class users build models under, and the class ``safe_zero.initialize``
    binds where ZeRO-3 partitions a model that is not partitioned yet. Inside ``safe_zero.initialize``
    it joins that call's session; elsewhere its options come from the ``"safe_zero"`` block of
    ``config_dict_or_path``/``config`` (without a config every fix is ``"auto"``).
    """

    @overrides
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        arguments = _STOCK_SIGNATURE.bind(self, *args, **kwargs).arguments
        session = current_session()
        if session is None:
            config = arguments.get("config_dict_or_path") or arguments.get("config")
            session = Session(options=SafeZeroOptions.from_config(resolve_config({"config": config})))
        # A model given whole is adopted after partitioning, only if it has zero-element parameters (as
        # the ZeRO-3 engine does); under the context manager they are not known yet, module by module.
        state_of(self, session).zero_element = ZeroElements(adopt_each=arguments.get("module") is None)
        # The quantizer is built in the stock constructor, from the module global; bind the guarded
        # one (and this session, which it captures) just for that call.
        with made_current(session), swapped(partition_parameters, "CUDAQuantizer", SafeCUDAQuantizer):
            super().__init__(*args, **kwargs)
        module = arguments.get("module")
        if module is not None and session.uses(FIX):
            params = list(module.parameters())
            if any(is_zero_element(p) for p in params):
                adopt(params, session)

    @overrides
    def _convert_to_deepspeed_param(self, param: torch.nn.Parameter) -> None:
        super()._convert_to_deepspeed_param(param)
        state = state_of(self)
        assert state.zero_element is not None  # __init__ gave it
        if state.zero_element.adopt_each and state.session.uses(FIX):
            adopt([param], state.session)
