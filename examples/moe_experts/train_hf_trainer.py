"""Fine-tune a tiny remote-code-style MoE (experts in an ``nn.ModuleList``) at ZeRO-3 with the HF ``Trainer``.

From the repository root, on 2 CPU processes:

    accelerate launch --config_file examples/accelerate/zero3.yaml --num_processes 2 \\
        examples/moe_experts/train_hf_trainer.py

Nothing in this script or its DeepSpeed JSON (``examples/moe_experts/zero3.json``: ZeRO-3 with every
parameter gathered on use) names a leaf module: ``SafeZeroCallback`` lets safe_zero find the MoE blocks
and gather each one whole, so ranks whose tokens pick different experts stay in step. Each rank prints
``[moe_experts rank R/W] ZeRO-3 losses: ...; safe_zero engaged: ...``; rank 0 then prints the report.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # modeling_tiny_moe.py
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/run_report.py

import torch  # noqa: E402

from modeling_tiny_moe import TinyMoeConfig, TinyMoeForCausalLM  # noqa: E402
from run_report import leave, report_trainer_run  # noqa: E402
from safe_zero.accelerate import SafeZeroCallback, cpu_distributed_state  # noqa: E402


class RepeatedBatches(torch.utils.data.Dataset):
    """Short sequences, different on every rank's shard, so each rank routes its few tokens to its own experts."""

    def __init__(self, size: int, length: int = 6) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 128, (size, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-config", default="examples/moe_experts/zero3.json")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-dir", default="moe_experts_out")
    args = parser.parse_args()

    configured = cpu_distributed_state()  # gloo for several processes on a CPU host
    from transformers import Trainer, TrainingArguments

    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.ds_config, bf16=torch.cuda.is_available(),
        per_device_train_batch_size=1, max_steps=args.steps, learning_rate=1e-2, weight_decay=0.0,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        accelerator_config={"use_configured_state": configured})
    torch.manual_seed(0)
    model = TinyMoeForCausalLM(TinyMoeConfig())
    world = training_args.world_size
    # The same few sequences every step: the loss must fall.
    trainer = Trainer(model=model, args=training_args, train_dataset=RepeatedBatches(world),
                      callbacks=[SafeZeroCallback()])
    trainer.train()

    report_trainer_run("moe_experts", trainer)


if __name__ == "__main__":
    main()
    leave()
