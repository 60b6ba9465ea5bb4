"""Fine-tune a tiny LLaVA on mixed image and text-only samples at ZeRO-3 with the HF ``Trainer``.

From the repository root, on 2 CPU processes:

    accelerate launch --config_file examples/accelerate/zero3.yaml --num_processes 2 \\
        examples/vlm_tower/train_hf_trainer.py            # add --stock: stock DeepSpeed, which fails

The model is transformers' ``LlavaForConditionalGeneration`` built from a small config (a CLIP vision tower, a
projector, a Llama language model). Each step one rank's sample carries an image and the other's is text only,
so only that rank runs the vision tower and the projector: stock ZeRO-3 gathers different parameters on the two
ranks and hangs or stops. Nothing here names the tower (``examples/vlm_tower/zero3.json`` has no ``safe_zero``
block) and no rank pushes a dummy image through it: safe_zero finds in the first step that some ranks skip the
tower, keeps it gathered on every rank, and the ranks that skip it contribute zero gradients, as DDP does. Each
rank prints ``[vlm_tower rank R/W] ZeRO-3 losses: ...; safe_zero engaged: ...``; rank 0 then prints the report,
which says what keeping the tower gathered costs per rank.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/run_report.py

import torch  # noqa: E402

import safe_zero.accelerate  # noqa: E402
from run_report import leave, report_trainer_run  # noqa: E402
from safe_zero.accelerate import SafeZeroCallback, cpu_distributed_state  # noqa: E402

IMAGE_TOKEN = 63
IMAGE_TOKENS = 4  # (16 / 8)^2 patches of the CLIP tower below, its CLS token dropped


def tiny_llava() -> torch.nn.Module:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8, projection_dim=16)
    text = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                     image_token_index=IMAGE_TOKEN, vision_feature_layer=-1))


class MixedSamples(torch.utils.data.Dataset):
    """Half the samples carry an image (its tokens in the text), half are text only; the same ones every epoch."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.text = torch.randint(1, IMAGE_TOKEN, (size, 6), generator=g)
        self.images = torch.randn(size, 3, 16, 16, generator=g)

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i % 2:
            return {"input_ids": self.text[i], "labels": self.text[i]}
        ids = torch.cat([self.text[i][:1], torch.full((IMAGE_TOKENS,), IMAGE_TOKEN), self.text[i][1:]])
        labels = torch.where(ids == IMAGE_TOKEN, -100, ids)
        return {"input_ids": ids, "labels": labels, "pixel_values": self.images[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds-config", default="examples/vlm_tower/zero3.json")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-dir", default="vlm_tower_out")
    parser.add_argument("--stock", action="store_true",
                        help="stock DeepSpeed: no SafeZeroCallback, safe_zero's routing unbound (fails)")
    args = parser.parse_args()

    configured = cpu_distributed_state()  # gloo for several processes on a CPU host
    from transformers import Trainer, TrainingArguments

    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.ds_config, bf16=torch.cuda.is_available(),
        per_device_train_batch_size=1, max_steps=args.steps, learning_rate=1e-2, weight_decay=0.0,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        accelerator_config={"use_configured_state": configured})
    world = training_args.world_size
    # One sample per rank per step, one of them with an image: which rank runs the tower changes with the shuffle.
    callbacks = [SafeZeroCallback()]
    if args.stock:
        callbacks = []
        safe_zero.accelerate.uninstall_on_request()  # importing safe_zero.accelerate bound it
    trainer = Trainer(model=tiny_llava(), args=training_args, train_dataset=MixedSamples(world), callbacks=callbacks)
    trainer.train()

    report_trainer_run("vlm_tower", trainer)


if __name__ == "__main__":
    main()
    leave()
