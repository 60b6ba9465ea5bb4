"""Lightning's ZeRO checkpoint converter, with safe_zero's fp32 reconstruction."""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

from safe_zero.errors import SafeLightningError
from safe_zero.patching import swapped

#: The name Lightning's converter looks up in DeepSpeed's ``zero_to_fp32`` when it runs: where safe_zero stands in.
_FP32_STATE_DICT = "get_fp32_state_dict_from_zero_checkpoint"


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_file: str | os.PathLike,
                                               tag: str | None = None) -> dict[str, Any]:
    """Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` (same arguments, same file and return value) with
    the fp32 weights from :func:`safe_zero.get_fp32_state_dict_from_zero_checkpoint`.

    Lightning's converter calls DeepSpeed's ``zero_to_fp32``, which leaves zero-element parameters out (ZeRO-1, and
    before DeepSpeed 0.19.8 wherever safe_zero keeps them out of the flat groups) or fails on them (DeepSpeed
    0.18.3: ``range(None, ...)``), so the converted file does not load with ``strict=True``. This one has every
    parameter with its real shape; Lightning's own code does the rest (its client state, the prefix it strips).
    Uses ``lightning.pytorch``, else the standalone ``pytorch_lightning``.

    Raises ``SafeLightningError``, before writing anything, where the installed Lightning does not look the fp32
    weights up in ``deepspeed.utils.zero_to_fp32`` when it runs (safe_zero could not stand in there).
    """
    from deepspeed.utils import zero_to_fp32

    from safe_zero.fixes.zero3_zero_element_params import get_fp32_state_dict_from_zero_checkpoint

    convert = _lightning_converter()
    if _FP32_STATE_DICT not in getattr(getattr(convert, "__code__", None), "co_names", ()):
        raise SafeLightningError(
            f"this Lightning's convert_zero_checkpoint_to_fp32_state_dict does not look up {_FP32_STATE_DICT} in "
            "deepspeed.utils.zero_to_fp32 when it runs, so safe_zero cannot give it zero-element parameters. Use "
            f"safe_zero.{_FP32_STATE_DICT}(checkpoint_dir, tag) and save its state dict.")
    with swapped(zero_to_fp32, _FP32_STATE_DICT, get_fp32_state_dict_from_zero_checkpoint):
        return convert(checkpoint_dir, output_file, tag=tag)


def _lightning_converter() -> Callable[..., dict[str, Any]]:
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(f"{package}.utilities.deepspeed").convert_zero_checkpoint_to_fp32_state_dict
        except ImportError:
            continue
    raise SafeLightningError("convert_zero_checkpoint_to_fp32_state_dict needs Lightning: "
                             "pip install 'safe-zero[lightning]'")
