"""Fine-tune a tiny GPT-OSS whose experts run through grouped_mm, at ZeRO-2 and ZeRO-3, with Lightning.

From the repository root (CPU or GPU):

    python examples/moe_grouped_mm/train.py                    # ZeRO-2, then ZeRO-3, 6 steps each
    python examples/moe_grouped_mm/train.py --stages 3 --steps 4
    python examples/moe_grouped_mm/train.py --compare          # CPU: also each stage with alignment off

The model is built offline from a ``GptOssConfig`` (hidden 64, 4 experts, expert intermediate 32,
2 attention heads).
Its experts class is decorated with transformers' ``@use_experts_implementation`` and defaults to
``"grouped_mm"``, which on CUDA needs every expert weight at a 16-byte aligned address. ZeRO's flat
buffers place parameters back to back, and GPT-OSS has small parameters (per layer, 2 attention sinks and a
4-element router bias: 12 bytes in bf16) that push the expert weights after them off that grid; safe_zero finds the
grouped_mm weights and keeps them aligned. The script prints, for each stage, the losses and the
expert weights' ``data_ptr() % 16`` as seen by the experts' forward in the last step (0 = aligned).
The only safe_zero lines are ``import safe_zero`` and the strategy name.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import safe_zero  # registers the safe_deepspeed_* strategy names
from safe_zero.lightning import SafeDeepSpeedStrategy

#: The tiny GPT-OSS: hidden 64, 4 experts with intermediate size 32, 2 of them per token.
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              sliding_window=16, layer_types=["sliding_attention", "full_attention"])
SEQUENCE = 16


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG))
    model.train()
    return model


class ExpertAlignment:
    """Records ``data_ptr() % 16`` of the grouped_mm expert weights each time their experts module runs forward.

    Under ZeRO-3 the weights are gathered only around the forward, so that is where to look.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.weights = safe_zero.grouped_mm_parameters(model)  # what safe_zero keeps aligned, by name
        self.seen: dict[str, int] = {}
        owners = {name.rsplit(".", 1)[0] for name in self.weights}
        for name, module in model.named_modules():
            if name in owners:
                module.register_forward_pre_hook(self._record(name))

    def _record(self, owner: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            for name, param in module.named_parameters(recurse=False):
                if f"{owner}.{name}" in self.weights:
                    self.seen[f"{owner}.{name}"] = param.data_ptr() % 16
        return hook


class FineTune(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.losses: list[float] = []
        self.alignment = ExpertAlignment(model)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().float().item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


def dataset(steps: int, batch_size: int = 2, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The same ``batch_size`` sequences in every batch (unshuffled): the loss must fall as the model fits them."""
    ids = torch.randint(0, CONFIG["vocab_size"], (batch_size, SEQUENCE), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for _ in range(steps) for row in ids]


def train(stage: int, steps: int, lr: float, alignment: bool = True) -> FineTune:
    """Fine-tune at ZeRO-``stage``; ``alignment=False`` turns safe_zero's alignment off, to show what it prevents."""
    strategy: str | SafeDeepSpeedStrategy = f"safe_deepspeed_stage_{stage}"
    tag = "[moe]"
    if not alignment:
        strategy = SafeDeepSpeedStrategy(stage=stage)
        strategy.config["safe_zero"] = {"alignment": False, "alignment_guard": False}
        tag = "[moe, alignment off]"
    module = FineTune(build_model(), lr)
    trainer = pl.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=1, strategy=strategy,
        precision="bf16-mixed", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    trainer.fit(module, DataLoader(dataset(steps), batch_size=2))
    report = trainer.strategy.model.safe_zero_session.report
    print(f"{tag} ZeRO-{stage} losses: {' '.join(f'{v:.4f}' for v in module.losses)}; "
          f"safe_zero engaged: {', '.join(sorted(report)) or 'none'}", flush=True)
    for name, offset in module.alignment.seen.items():
        print(f"{tag} ZeRO-{stage} {name} data_ptr() % 16 = {offset}", flush=True)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", choices=(2, 3), default=[2, 3])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--compare", action="store_true",
                        help="also train each stage with safe_zero's alignment turned off (CPU only: CUDA grouped_mm "
                             "refuses the misaligned weights)")
    args = parser.parse_args()
    if args.compare and torch.cuda.is_available():
        parser.error("--compare needs a CPU run: on CUDA, grouped_mm raises on the misaligned expert weights")
    for stage in args.stages:
        train(stage, args.steps, args.lr)
        if args.compare:
            train(stage, args.steps, args.lr, alignment=False)


if __name__ == "__main__":
    main()
