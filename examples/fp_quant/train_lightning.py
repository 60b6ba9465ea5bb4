"""Fine-tune a tiny FP-Quant Llama with Lightning and ``strategy="safe_deepspeed_stage_3"``. From the repository root:

    python examples/fp_quant/train_lightning.py                 # ZeRO-3, 8 steps, CPU or GPU
    python examples/fp_quant/train_lightning.py --stage 2 --steps 4

Stock ``strategy="deepspeed_stage_3"`` fails on this model (``'status': 'NOT_AVAILABLE', 'numel': 0``
for FP-Quant's zero-sized placeholders; ZeRO-2: ``'NoneType' object has no attribute 'view'`` for
its gradient-less ``dqweight``). The only safe_zero lines are ``import safe_zero`` and the strategy name.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py, cpu_support.py

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import safe_zero  # noqa: E402,F401  registers the safe_deepspeed_* strategy names
from model import build_checkpoint, dataset, describe, load_model, summarize  # noqa: E402


class FineTune(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().float().item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="fp_quant_tiny", help="where the tiny FP-Quant checkpoint is built")
    parser.add_argument("--stage", type=int, choices=(2, 3), default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    model = load_model(build_checkpoint(args.workdir))
    print(f"FP-Quant model: {describe(model)}", flush=True)
    module = FineTune(model, args.lr)
    trainer = pl.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=1,
        strategy=f"safe_deepspeed_stage_{args.stage}", precision="bf16-mixed", max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(dataset(args.steps), batch_size=2))

    session = trainer.strategy.model.safe_zero_session  # the engine safe_zero built: which fixes acted
    report = session.report
    print(f"[lightning] ZeRO-{args.stage} losses: {' '.join(f'{v:.4f}' for v in module.losses)}; "
          f"safe_zero engaged: {', '.join(sorted(report)) or 'none'}", flush=True)
    print(summarize(session), flush=True)


if __name__ == "__main__":
    main()
