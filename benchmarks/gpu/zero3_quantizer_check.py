"""GPU check: DeepSpeed's real ZeRO-3 CUDA weight quantizer on an empty partition, stock vs safe_zero.

CPU CI reaches the guard only through a pure-torch stand-in for the compiled kernels
(``tests/fixes/test_zero3_zero_element_params.py``); this script runs the real ``QuantizerBuilder``
kernels. One GPU, one process; most of its time is the kernel's JIT build. Run from the repo
root (``benchmarks/gpu_check.sh`` does). Prints one ``RESULT`` line per check, exits 1 if any fails.

Checks:
1. stock ``CUDAQuantizer.quantize`` on an empty tensor raises ``ZeroDivisionError`` (the defect);
2. safe_zero's quantizer returns an empty int8 tensor and empty scales, and dequantizes them to
   an empty tensor of the requested dtype;
3. on a sized tensor safe_zero's quantizer returns exactly what stock's does;
4. end to end, ``zero_quantized_nontrainable_weights`` with a frozen zero-element layer: stock
   ``deepspeed.initialize`` raises ``ZeroDivisionError``; ``safe_zero.initialize`` trains 3 steps
   with finite, falling losses and the layer keeps its shape ``(0, 8)``;
5. the same with ``zero_quantized_weights``.
"""

from __future__ import annotations

import sys

from benchmarks.gpu._report import RESULTS, check, single_rank_env

single_rank_env(29517)

import torch  # noqa: E402

def _dequantize(quantizer, q, scale, dtype):
    try:  # DeepSpeed >= 0.19.8 takes the output dtype; older releases return the kernel's fp16
        return quantizer.dequantize(q, scale, dtype=dtype)
    except TypeError:
        return quantizer.dequantize(q, scale)


def kernel_checks() -> None:
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    from safe_zero.fixes.zero3_zero_element_params import SafeCUDAQuantizer

    empty = torch.empty(0, dtype=torch.bfloat16, device="cuda")
    try:
        CUDAQuantizer().quantize(empty)
        check("stock quantize(empty) raises ZeroDivisionError", False, "it no longer fails: re-check FIX.needed_on")
    except ZeroDivisionError as e:
        check("stock quantize(empty) raises ZeroDivisionError", True, str(e))

    safe = SafeCUDAQuantizer()
    q, scale = safe.quantize(empty)
    check("safe quantize(empty)", q.dtype == torch.int8 and q.numel() == 0 and scale.numel() == 0,
          f"{q.dtype} {tuple(q.shape)}, scales {tuple(scale.shape)}")
    out = _dequantize(safe, q, scale, torch.bfloat16)
    check("safe dequantize(empty)", out.numel() == 0 and out.device.type == "cuda", f"{out.dtype} {tuple(out.shape)}")

    x = torch.randn(4096, dtype=torch.half, device="cuda")
    (q_stock, s_stock), (q_safe, s_safe) = CUDAQuantizer().quantize(x), safe.quantize(x)
    same = torch.equal(q_stock, q_safe) and torch.equal(s_stock, s_safe)
    back_same = torch.equal(_dequantize(CUDAQuantizer(), q_stock, s_stock, torch.half),
                            _dequantize(safe, q_safe, s_safe, torch.half))
    check("safe quantizer == stock on a sized tensor", same and back_same)


class Quantizable(torch.nn.Module):
    """Partitions the quantizer accepts (multiples of 8 elements) and a frozen zero-element layer."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(8, 16)
        self.empty = torch.nn.Linear(8, 0, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x).pow(2).mean() + self.empty(x).sum()


def engine_check(flag: str) -> None:
    import deepspeed

    import safe_zero

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, flag: True},
        "steps_per_print": 10**9,
    }

    def run(init):
        torch.manual_seed(0)
        model = Quantizable()
        engine, *_ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                          config=config)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
        losses = []
        for _ in range(3):
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        with deepspeed.zero.GatheredParameters([engine.module.empty.weight]):
            shape = tuple(engine.module.empty.weight.shape)
        return losses, shape

    try:
        run(deepspeed.initialize)
        stock = "trains"
    except Exception as e:  # noqa: BLE001 - report whatever stock does
        stock = f"{type(e).__name__}: {e}"
    if flag == "zero_quantized_nontrainable_weights":
        check(f"stock {flag} fails", stock.startswith("ZeroDivisionError"), stock[:200])
    else:  # the fetch gate fails first here: a submodule whose only parameter is empty
        check(f"stock {flag} fails", "NOT_AVAILABLE" in stock, stock[:200])
    try:
        losses, shape = run(safe_zero.initialize)
        ok = all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] and shape == (0, 8)
        check(f"safe_zero {flag} trains", ok, f"losses {losses}, empty shape {shape}")
    except Exception as e:  # noqa: BLE001
        check(f"safe_zero {flag} trains", False, f"{type(e).__name__}: {e}")


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    import deepspeed

    deepspeed.init_distributed()
    kernel_checks()
    engine_check("zero_quantized_nontrainable_weights")
    engine_check("zero_quantized_weights")
    return 0 if all(RESULTS.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
