"""TRL ``SFTTrainer`` on a tiny FP-Quant Llama, at ZeRO-2 or ZeRO-3. From the repository root:

    accelerate launch --config_file examples/trl/zero3.yaml examples/trl/sft_fp_quant.py      # 2 processes
    accelerate launch --config_file examples/trl/zero2.yaml examples/trl/sft_fp_quant.py
    python examples/trl/sft_fp_quant.py                                    # 1 process, examples/trl/zero3.json
    accelerate launch --config_file examples/trl/zero3.yaml examples/trl/sft_fp_quant.py --stock   # fails

The model is the checkpoint of ``examples/fp_quant/`` (built offline into ``--workdir`` on first use):
in each of its 14 quantized linears, FP-Quant installs zero-sized ``(0,)`` placeholder parameters
(``weight``, ``qweight``) and a trainable ``dqweight`` that never gets a gradient. Stock DeepSpeed
fails on both (``--stock`` shows it): at ZeRO-3 on 2 processes ``torch.cat(): expected a non-empty
list of Tensors``; at ZeRO-2 ``Invalid to reduce Param 14 with None gradient`` with this folder's
``"reduce_bucket_size": "auto"``, ``'NoneType' object has no attribute 'view'`` with larger buckets.

What is trained: the parts FP-Quant leaves unquantized (embeddings, norms, ``lm_head``), in full;
the quantized linears cannot learn without master weights. No LoRA: PEFT refuses it on FP-Quant's
``FPQuantLinear`` ("Target module FPQuantLinear() is not supported"), and TRL refuses it on
``lm_head``, the one linear left unquantized here.

The safe_zero lines: ``allow_trainer_fine_tuning(model)`` (transformers' Trainer, and so TRL, refuses
FP-Quant models without master weights otherwise) and ``callbacks=[SafeZeroCallback()]``.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # common.py
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "fp_quant"))  # model.py, cpu_support.py

from common import dataset, emit, finish, on_cpu, report_run, single_process_rendezvous, tokenizer  # noqa: E402

DEFAULT_DEEPSPEED = "examples/trl/zero3.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="fp_quant_tiny", help="where the tiny FP-Quant checkpoint is built")
    parser.add_argument("--deepspeed", default=None,
                        help=f"DeepSpeed JSON (default: the launch yaml's; {DEFAULT_DEEPSPEED} without a launcher)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--stock", action="store_true",
                        help="stock DeepSpeed: no SafeZeroCallback, safe_zero's routing unbound (fails)")
    args = parser.parse_args()

    launched_with_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    single_process_rendezvous()

    from trl import SFTConfig, SFTTrainer

    import safe_zero.accelerate
    from model import build_checkpoint, describe, load_model  # examples/fp_quant/model.py
    from safe_zero.accelerate import SafeZeroCallback, allow_trainer_fine_tuning

    config = SFTConfig(
        output_dir=os.path.join(args.workdir, "trl_sft"),
        deepspeed=args.deepspeed or (None if launched_with_deepspeed else DEFAULT_DEEPSPEED),
        use_cpu=on_cpu(),  # CPU host: allows TRL's bf16=True default and gives the processes a gloo group
        per_device_train_batch_size=2, max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        max_length=64, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential")  # every batch holds both examples: the loss must fall
    with config.main_process_first():  # the main process builds the checkpoint, the others then load it
        model = load_model(build_checkpoint(args.workdir))
    if config.process_index == 0:
        emit(f"FP-Quant model: {describe(model)}")

    allow_trainer_fine_tuning(model)  # transformers refuses FP-Quant without master weights otherwise
    callbacks = [SafeZeroCallback()]
    if args.stock:
        callbacks = []
        safe_zero.accelerate.uninstall_on_request()  # importing safe_zero.accelerate bound it
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset(args.steps, config.world_size, 2),
                         processing_class=tokenizer(), callbacks=callbacks)
    trainer.train()
    report_run(trainer, "trl-fp-quant")


if __name__ == "__main__":
    main()
    finish()
