"""Fine-tune a tiny FP-Quant Llama with the HF ``Trainer`` and ``SafeZeroCallback``. From the repository root:

    python examples/fp_quant/train_hf_trainer.py                       # ZeRO-3, 1 process
    accelerate launch --config_file examples/accelerate/zero3.yaml examples/fp_quant/train_hf_trainer.py

DeepSpeed is configured as usual, with ``TrainingArguments(deepspeed="examples/accelerate/zero3.json")``
(``--ds-config`` picks another). The safe_zero lines: ``allow_trainer_fine_tuning(model)`` (the Trainer
refuses FP-Quant models without master weights otherwise) and the callback. On a host without a GPU
the script passes ``use_cpu=True``: transformers then allows ``bf16=True`` (``"bf16": "auto"`` in the
JSON follows it) and sets up the processes' gloo group itself.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py, cpu_support.py

import torch  # noqa: E402

from model import build_checkpoint, dataset, describe, load_model, summarize  # noqa: E402
from safe_zero.accelerate import SafeZeroCallback, allow_trainer_fine_tuning  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="fp_quant_tiny", help="where the tiny FP-Quant checkpoint is built")
    parser.add_argument("--ds-config", default="examples/accelerate/zero3.json")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    if "LOCAL_RANK" not in os.environ:
        # `python train_hf_trainer.py` without a launcher: DeepSpeed still needs a (one-process) rendezvous.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))

    from transformers import Trainer, TrainingArguments

    training_args = TrainingArguments(
        output_dir=os.path.join(args.workdir, "hf_trainer"), deepspeed=args.ds_config, bf16=True,
        use_cpu=not torch.cuda.is_available(),  # CPU host: transformers allows bf16 and sets up gloo itself
        per_device_train_batch_size=2, max_steps=args.steps, learning_rate=args.lr, weight_decay=0.0,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    with training_args.main_process_first():  # the main process builds the checkpoint, the others then load it
        model = load_model(build_checkpoint(args.workdir))
    allow_trainer_fine_tuning(model)  # the Trainer refuses FP-Quant without master weights otherwise
    rank = training_args.process_index
    if rank == 0:
        print(f"FP-Quant model: {describe(model)}", flush=True)
    world = training_args.world_size
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset(args.steps * world),
                      callbacks=[SafeZeroCallback()])
    trainer.train()

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    session = engine.safe_zero_session
    report = session.report
    # One write, newline included: the ranks share one pipe, and print() writes text and newline apart.
    print(f"[hf_trainer rank {rank}/{world}] ZeRO-{engine.zero_optimization_stage()} losses: "
          f"{' '.join(f'{v:.4f}' for v in losses)}; safe_zero engaged: {', '.join(sorted(report)) or 'none'}\n",
          end="", flush=True)
    if rank == 0:
        print(summarize(session), flush=True)


if __name__ == "__main__":
    main()
