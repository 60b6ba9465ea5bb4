"""Fine-tune a tiny FP-Quant Llama with ``accelerate launch`` and ``SafeDeepSpeedPlugin``. From the repository root:

    accelerate launch --config_file examples/accelerate/zero3.yaml examples/fp_quant/train_accelerate.py
    accelerate launch --config_file examples/accelerate/zero2.yaml --num_processes 1 \\
        examples/fp_quant/train_accelerate.py --steps 4

Every DeepSpeed setting comes from the launch config and the DeepSpeed JSON it names
(``examples/accelerate/*.json``, which carry the ``"safe_zero"`` block); the only safe_zero line
is the plugin. Runs on CPU (gloo) as well as on GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model.py, cpu_support.py

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from model import build_checkpoint, dataset, describe, load_model, summarize  # noqa: E402
from safe_zero.accelerate import SafeDeepSpeedPlugin  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="fp_quant_tiny", help="where the tiny FP-Quant checkpoint is built")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    # bf16 fills the JSON's "bf16": {"enabled": "auto"}; the plugin reads everything else from the launch.
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=SafeDeepSpeedPlugin())
    with accelerator.main_process_first():
        checkpoint = build_checkpoint(args.workdir)
    model = load_model(checkpoint)
    if accelerator.is_main_process:
        print(f"FP-Quant model: {describe(model)}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = DataLoader(dataset(args.steps * accelerator.num_processes), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)

    losses = []
    for batch in data:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.float().item())

    session = model.safe_zero_session  # the engine safe_zero built keeps what its fixes did
    report = session.report
    # One write, newline included: the ranks share one pipe, and print() writes text and newline apart.
    print(f"[accelerate rank {accelerator.process_index}/{accelerator.num_processes}] "
          f"ZeRO-{accelerator.state.deepspeed_plugin.zero_stage} losses: {' '.join(f'{v:.4f}' for v in losses)}; "
          f"safe_zero engaged: {', '.join(sorted(report)) or 'none'}\n", end="", flush=True)
    if accelerator.is_main_process:
        print(summarize(session), flush=True)
    accelerator.end_training()  # waits for every process and tears the process group down


if __name__ == "__main__":
    main()
