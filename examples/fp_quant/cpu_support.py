"""CPU SUPPORT FOR THE FP-QUANT EXAMPLE -- not part of safe_zero, not needed on a GPU.

FP-Quant (PyPI ``fp-quant``, used by transformers' ``FPQuantConfig``) runs its pseudo-quantization
through two triton GPU kernels, and transformers refuses FP-Quant without a GPU. So that the example
and its test run on a CPU-only machine, :func:`enable` makes three substitutions, each only when no
CUDA/XPU device is present (on a GPU it does nothing and the real kernels run):

1. ``fp_quant.module.pseudoquant_linear_fns.{mxfp4,nvfp4}_forward_kernel_wrapper`` (triton) are
   replaced by the pure-torch equivalents below: Hadamard rotation per ``hadamard_dim`` block, a
   scale per 32 (MXFP4) or 16 (NVFP4) values, rounding onto the FP4 (E2M1) grid, dequantization.
   They follow the triton kernels of fp-quant 0.3.2 line by line (``fp_quant/module/triton/*.py``).
2. ``FPQuantHfQuantizer.validate_environment`` refuses any machine without CUDA/XPU; for
   pseudo-quantization it is replaced by a check that fp-quant is installed.
3. In-flight quantization (``FpQuantQuantize.convert``) enters ``torch.<device type>.device(...)``;
   torch 2.13 has no ``torch.cpu.device``, so a no-op context manager is provided for it.

None of this touches DeepSpeed or safe_zero: the parameters FP-Quant creates (the zero-sized
``weight``/``qweight``/``scales`` placeholders and the trainable ``dqweight`` that never gets a
gradient) are exactly those of a GPU run.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

#: The FP4 (E2M1) magnitudes and the midpoints the triton kernels round at.
_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _round_to_fp4(scaled: torch.Tensor) -> torch.Tensor:
    magnitude = scaled.abs()
    grid = torch.tensor(_FP4_GRID, dtype=scaled.dtype, device=scaled.device)
    thresholds = torch.tensor(_FP4_THRESHOLDS, dtype=scaled.dtype, device=scaled.device)
    # The kernels pick the grid point above each strict threshold ("> t"): bucketize(right=False) counts t < x.
    fp4 = grid[torch.bucketize(magnitude, thresholds, right=False)]
    return torch.where(scaled > 0, fp4, -fp4)


def _rotate(x: torch.Tensor, hadamard_matrix: torch.Tensor) -> torch.Tensor:
    hadamard_dim = hadamard_matrix.shape[-1]
    return x.reshape(-1, hadamard_dim).float() @ hadamard_matrix.float()


def mxfp4_forward_torch(x: torch.Tensor, hadamard_matrix: torch.Tensor, return_clip_mask: bool = False,
                        gaussian_scale: float = 3 / 4, quest: bool = True) -> tuple[torch.Tensor, Any]:
    """Pure-torch ``mxfp4_forward_kernel_wrapper``: rotated, MXFP4-rounded and dequantized ``x`` (and clip mask)."""
    grouped = _rotate(x.contiguous(), hadamard_matrix).reshape(-1, 32)
    if quest:
        mean = grouped.mean(dim=-1, keepdim=True)
        std = torch.sqrt((grouped * grouped).mean(dim=-1, keepdim=True) - mean * mean)
        shared_exps = torch.exp2(torch.floor(torch.log2(gaussian_scale * std + 1e-8)))
    else:
        scales = grouped.abs().amax(dim=-1, keepdim=True)
        shared_exps = torch.exp2(torch.floor(torch.log2(scales)) - 2) / (3 / 4)
    scaled = grouped / shared_exps
    output = (_round_to_fp4(scaled) * shared_exps).reshape(x.shape).to(x.dtype)
    clip_mask = (scaled.abs() < 6).reshape(x.shape) if return_clip_mask else None
    return output, clip_mask


def nvfp4_forward_torch(x: torch.Tensor, hadamard_matrix: torch.Tensor,
                        global_scale: torch.Tensor | None) -> torch.Tensor:
    """Pure-torch ``nvfp4_forward_kernel_wrapper``: rotated, NVFP4-rounded and dequantized ``x``."""
    grouped = _rotate(x.contiguous(), hadamard_matrix).reshape(-1, 16)
    scale_all = global_scale.float().reshape(()) if global_scale is not None else torch.tensor(1.0)
    # NVFP4 stores its block scales in FP8 E4M3, as the kernel's `.to(tl.float8e4nv)`.
    scale = (scale_all * grouped.abs().amax(dim=-1, keepdim=True) / 6).to(torch.float8_e4m3fn).float()
    scaled = grouped * scale_all / scale
    return (_round_to_fp4(scaled) * scale / scale_all).reshape(x.shape).to(x.dtype)


def _gpu_present() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def enable() -> bool:
    """Make FP-Quant pseudo-quantization run on this CPU-only machine; returns whether anything was patched.

    Idempotent. Does nothing where a CUDA or XPU device is present.
    """
    if _gpu_present():
        return False
    import fp_quant.module.pseudoquant_linear_fns as pseudoquant
    from transformers.quantizers.quantizer_fp_quant import FPQuantHfQuantizer
    from transformers.utils import is_fp_quant_available

    # 1. The triton kernels, looked up as module globals by forward_pseudoquantize at call time.
    pseudoquant.mxfp4_forward_kernel_wrapper = mxfp4_forward_torch
    pseudoquant.nvfp4_forward_kernel_wrapper = nvfp4_forward_torch

    # 2. transformers' GPU-only environment check, for pseudo-quantization only.
    stock_validate = getattr(FPQuantHfQuantizer.validate_environment, "__wrapped_stock__",
                             FPQuantHfQuantizer.validate_environment)

    def validate_environment(self: Any, device_map: Any, **kwargs: Any) -> None:
        if not self.quantization_config.pseudoquantization:
            return stock_validate(self, device_map, **kwargs)  # real quantization needs a Blackwell GPU anyway
        if not is_fp_quant_available():
            raise ImportError("FP-Quant quantization requires fp_quant: `pip install fp_quant`")

    validate_environment.__wrapped_stock__ = stock_validate  # type: ignore[attr-defined]
    FPQuantHfQuantizer.validate_environment = validate_environment

    # 3. `with torch.cpu.device(...)` in FpQuantQuantize.convert; nothing to select on a CPU.
    if not hasattr(torch.cpu, "device"):
        torch.cpu.device = lambda device: contextlib.nullcontext()  # type: ignore[attr-defined]
    return True
