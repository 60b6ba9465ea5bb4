"""HF Trainer script for ``tests/accelerate/test_trainer_resume.py``: a stock-written checkpoint resumed through
safe_zero.

A tiny GPT-OSS (grouped_mm experts behind 2-element attention sinks) trains 4 steps with the stock Trainer at ZeRO-2,
saving at step 2 (mode ``stock``). Mode ``safe`` resumes that step-2 checkpoint with ``SafeZeroCallback`` (which turns
DeepSpeed's ``parameter_alignment`` on, so the layouts differ). Each prints ``RESULT <json>`` with the logged losses.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.accelerate.trainer_script import Repeat  # the repository root is on PYTHONPATH (tests/accelerate/launch.py)

STEPS = 4


def main() -> None:
    from transformers import GptOssConfig, GptOssForCausalLM, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    mode, out = sys.argv[1], sys.argv[2]
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=32, intermediate_size=32,
                                           num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                                           max_position_embeddings=64))
    from transformers import TrainerCallback

    class CountSteps(TrainerCallback):
        ran = 0

        def on_step_end(self, *args, **kwargs):
            CountSteps.ran += 1

    callbacks, configured = [CountSteps()], False
    if mode == "safe":
        from safe_zero.accelerate import SafeZeroCallback, cpu_distributed_state

        callbacks, configured = [*callbacks, SafeZeroCallback()], cpu_distributed_state()
    args = TrainingArguments(output_dir=out, deepspeed="examples/accelerate/zero2.json", per_device_train_batch_size=2,
                             max_steps=STEPS, learning_rate=3e-3, logging_steps=1, save_strategy="steps", save_steps=2,
                             report_to=[], disable_tqdm=True, accelerator_config={"use_configured_state": configured})
    trainer = Trainer(model=model, args=args, train_dataset=Repeat(2 * STEPS), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=f"{out}/checkpoint-2" if mode == "safe" else None)
    engine = trainer.model_wrapped
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    sys.stdout.write("RESULT " + json.dumps({"phase": mode, "rank": 0, "losses": losses, "steps_run": CountSteps.ran,
                                             "safe": hasattr(engine, "safe_zero_session")}) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
