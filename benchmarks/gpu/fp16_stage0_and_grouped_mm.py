"""GPU check: fp16 stage 0 with a zero-sized parameter, and a CUDA grouped_mm step under ZeRO-2.

CPU CI cannot run either: DeepSpeed's CPU accelerator refuses fp16, and CPU ``grouped_mm`` does not
check ``data_ptr() % 16``. One GPU, one process; run from the repo root (``benchmarks/gpu_check.sh``
does). Prints one ``RESULT`` line per check and exits 1 if any fails.

1. fp16 stage 0 (fused ``FP16_Optimizer`` via DeepSpeed's ``FusedAdam``) with ``nn.Linear(8, 0)``:
   safe_zero keeps the shape ``(0, 8)`` after initialize and after 2 steps, with finite losses.
   (Stock fails only where torch's ``unflatten_dense_tensors`` drops the shape; the line says which.)
2. grouped_mm experts behind an odd-sized parameter under bf16 ZeRO-2, 3 steps: stock either hits
   CUDA's "expected data_ptr to be aligned to 16 bytes" or leaves the weight off the grid; safe_zero
   trains with the weight at ``data_ptr() % 16 == 0`` after every step.
"""

from __future__ import annotations

import sys

from benchmarks.gpu._report import RESULTS, check, single_rank_env

single_rank_env(29519)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from safe_zero.probes import ZeroSized  # noqa: E402

class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.odd = nn.Parameter(torch.randn(3) * 0.1)  # pushes what follows off the 16-byte grid
        self.experts = nn.Parameter(torch.randn(4, 64, 64) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([4, 8, 12, 16], device=x.device, dtype=torch.int32)
        out = torch._grouped_mm(x, self.experts, offs=offs)
        return (out.float().pow(2).mean() + self.odd.float().sum())


def _engine(init, model: nn.Module, config: dict, optimizer=None):
    engine, *_ = init(model=model, model_parameters=None if optimizer else model.parameters(), optimizer=optimizer,
                      config=config)
    return engine


def fp16_stage0() -> None:
    import deepspeed
    from deepspeed.ops.adam import FusedAdam

    import safe_zero

    for name, init in (("stock", deepspeed.initialize), ("safe_zero", safe_zero.initialize)):
        torch.manual_seed(0)
        model = ZeroSized().cuda()
        config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "initial_scale_power": 8},
                  "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
        try:
            engine = _engine(init, model, config, optimizer=FusedAdam(model.parameters(), lr=1e-3))
            shapes = [tuple(engine.module.empty.weight.shape)]
            losses = []
            for _ in range(2):
                loss = engine(torch.randn(2, 8, device="cuda", dtype=torch.half))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                shapes.append(tuple(engine.module.empty.weight.shape))
            ok = all(s == (0, 8) for s in shapes) and all(torch.isfinite(torch.tensor(losses)))
            check(f"fp16 stage 0 zero-sized, {name}", ok or name == "stock", f"shapes {shapes}, losses {losses}")
        except Exception as e:  # stock may raise on older torch; safe_zero must not
            check(f"fp16 stage 0 zero-sized, {name}", name == "stock", f"{type(e).__name__}: {e}")


def grouped_mm_zero2() -> None:
    import deepspeed

    import safe_zero

    for name, init in (("stock", deepspeed.initialize), ("safe_zero", safe_zero.initialize)):
        torch.manual_seed(0)
        model = Experts().cuda()
        if name == "safe_zero":
            safe_zero.mark_grouped_mm(model.experts)
        config = {"train_micro_batch_size_per_gpu": 16, "bf16": {"enabled": True}, "steps_per_print": 10**9,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
        try:
            engine = _engine(init, model, config)
            offsets = []
            for _ in range(3):
                loss = engine(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16))
                engine.backward(loss)
                engine.step()
                offsets.append(engine.module.experts.data_ptr() % 16)
            detail = f"data_ptr % 16 per step {offsets}"
            check(f"grouped_mm ZeRO-2, {name}", all(o == 0 for o in offsets) if name == "safe_zero" else True, detail)
        except RuntimeError as e:
            check(f"grouped_mm ZeRO-2, {name}", name == "stock" and "aligned to 16 bytes" in str(e), str(e)[:200])


def main() -> int:
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")
    fp16_stage0()
    grouped_mm_zero2()
    return 0 if all(RESULTS.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
