"""What ZeRO-3 adds at run time to torch's parameters and modules, as types for mypy: DeepSpeed sets these attributes
on plain ``nn.Parameter``/``nn.Module`` objects (``zero.Init._convert_to_deepspeed_param``, the hooks'
registration), so no class of theirs declares them. Imported under ``TYPE_CHECKING`` only: nothing is ever an
instance of these classes, and their methods only declare what the ones they stand for return."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn


class ZeROParameter(nn.Parameter):
    """A parameter as ZeRO-3 converts it."""

    ds_id: int
    ds_status: ZeroParamStatus
    ds_shape: torch.Size
    ds_numel: int
    ds_tensor: torch.Tensor
    ds_persist: bool
    ds_active_sub_modules: set[int]
    ds_process_group: Any
    all_gather: Callable[..., Any]
    all_gather_coalesced: Callable[..., Any]
    partition: Callable[..., Any]

    def partition_numel(self) -> int:
        raise NotImplementedError

    def ds_summary(self, use_debug_name: bool = False) -> dict[str, Any]:
        raise NotImplementedError


class ZeROModule(nn.Module):
    """A module of a ZeRO-3 model: DeepSpeed's id for it (the trace and the hooks know it by this)."""

    ds_id: int
    _parameters: Any  # DeepSpeed's ZeROOrderedDict

    def parameters(self, recurse: bool = True) -> Iterator[ZeROParameter]:
        raise NotImplementedError

    def modules(self, remove_duplicate: bool = True) -> Iterator[ZeROModule]:
        raise NotImplementedError


__all__ = ["ZeROModule", "ZeROParameter"]
