"""TRL ``SFTTrainer`` + PEFT LoRA on a tiny GPT-OSS whose experts run through grouped_mm. From the repository root:

    accelerate launch --config_file examples/trl/zero3.yaml examples/trl/sft_moe_lora.py      # 2 processes
    accelerate launch --config_file examples/trl/zero2.yaml examples/trl/sft_moe_lora.py
    python examples/trl/sft_moe_lora.py                                    # 1 process, examples/trl/zero3.json

LoRA goes on the attention projections (``target_modules``) and on the 3-D expert weights
(``target_parameters``: ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``). For the forward,
PEFT folds the low-rank update into the expert weight, so grouped_mm reads ``W + B @ A``, a fresh
tensor. The frozen base weights ``W`` are what ZeRO holds (at ZeRO-3, partitioned and gathered
around each forward); safe_zero's ``grouped_mm_alignment`` keeps them on the 16-byte grid CUDA
grouped_mm needs (they are what it reads once the adapter is merged, or with LoRA on attention
only), and its guard checks them after every step. The script prints ``data_ptr() % 16`` of both.

The only safe_zero line is ``callbacks=[SafeZeroCallback()]``. DeepSpeed is configured by the launch
yaml and the JSON it names (``--deepspeed`` overrides); on a host without a GPU the recipe passes
``use_cpu=True``, which lets TRL keep its ``bf16=True`` default and sets up gloo for the processes.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py

import torch  # noqa: E402

from common import dataset, emit, finish, on_cpu, report_run, single_process_rendezvous, tokenizer  # noqa: E402

#: The tiny GPT-OSS of examples/moe_grouped_mm/: hidden 64, 4 experts (intermediate 32), 2 per token.
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              sliding_window=16, layer_types=["sliding_attention", "full_attention"])
DEFAULT_DEEPSPEED = "examples/trl/zero3.json"


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    return GptOssForCausalLM(GptOssConfig(**CONFIG))


class ExpertAlignment:
    """Records ``data_ptr() % 16`` of the grouped_mm expert weights in their experts' forward, the last step's kept.

    For each weight, two tensors: the base weight ZeRO holds (under ZeRO-3 it exists only while gathered, around
    the forward: that is where to look), and what grouped_mm reads. With LoRA on the experts, PEFT registers a
    parametrization for the forward, so grouped_mm reads ``W + B @ A``, a fresh tensor; without LoRA there (or once
    the adapter is merged) it reads the base weight itself.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        import safe_zero

        self.base: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.kernel: dict[str, int] = {}
        self.weights = safe_zero.grouped_mm_parameters(model)  # what safe_zero keeps aligned, by name
        owners = {name.rsplit(".", 1)[0] for name in self.weights}
        for name, module in model.named_modules():
            if name in owners:
                module.register_forward_pre_hook(self._record(name))

    def _record(self, owner: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            parametrized = getattr(module, "parametrizations", {})
            for full_name in self.weights:
                name = full_name[len(owner) + 1:]
                if full_name.rsplit(".", 1)[0] != owner:
                    continue
                base = parametrized[name].original if name in parametrized else module._parameters[name]
                self.base[full_name] = base.data_ptr() % 16, tuple(base.shape)
                self.kernel[full_name] = getattr(module, name).data_ptr() % 16
        return hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", default=None,
                        help=f"DeepSpeed JSON (default: the launch yaml's; {DEFAULT_DEEPSPEED} without a launcher)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--output-dir", default="trl_moe_lora")
    args = parser.parse_args()

    launched_with_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    single_process_rendezvous()

    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from safe_zero.accelerate import SafeZeroCallback

    config = SFTConfig(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed or (None if launched_with_deepspeed else DEFAULT_DEEPSPEED),
        use_cpu=on_cpu(),  # CPU host: allows TRL's bf16=True default and gives the processes a gloo group
        per_device_train_batch_size=2, max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        max_length=64, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential")  # every batch holds both examples: the loss must fall
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

    model = build_model()
    alignment = ExpertAlignment(model)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset(args.steps, config.world_size, 2),
                         processing_class=tokenizer(), peft_config=lora, callbacks=[SafeZeroCallback()])
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)  # before ZeRO partitions them
    trainer.train()

    report_run(trainer, "trl-moe")
    if config.process_index == 0:
        emit(f"[trl-moe] GPT-OSS + LoRA: {trainable} trainable parameters (LoRA on q/k/v/o_proj and on the experts' "
             "gate_up_proj, down_proj)")
        stage = trainer.model_wrapped.zero_optimization_stage()
        for name in alignment.weights:
            offset, shape = alignment.base[name]
            emit(f"[trl-moe] ZeRO-{stage} {name} data_ptr() % 16 = {offset} (base weight {list(shape)}), "
                 f"{alignment.kernel[name]} (what grouped_mm reads)")


if __name__ == "__main__":
    main()
    finish()
