"""Train a model stock DeepSpeed cannot, with Accelerate and safe_zero. From the repository root:

    accelerate launch --config_file examples/accelerate/zero3.yaml examples/accelerate/train.py
    accelerate launch --config_file examples/accelerate/zero2.yaml examples/accelerate/train.py --steps 8

The model has what FP-Quant checkpoints have: a zero-sized parameter and a trainable parameter that
autograd leaves without a gradient. Stock DeepSpeed fails on both (ZeRO-2:
``'NoneType' object has no attribute 'view'``; ZeRO-3: ``'status': 'NOT_AVAILABLE', 'numel': 0``).
The only safe_zero line is the plugin: every other setting comes from the ``accelerate launch``
config and the DeepSpeed JSON it names. Runs on CPU (gloo) as well as on GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import Accelerator
from torch import nn

from safe_zero.accelerate import SafeDeepSpeedPlugin
# Uses a weight but returns no gradient for it, as FP-Quant's pseudo-quantized matmul does.
from safe_zero.probes import DropGrad


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.empty = nn.Linear(8, 0, bias=False)  # zero-sized weight, shape (0, 8)
        self.dqweight = nn.Parameter(torch.full((4, 8), 0.125))  # trainable, never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DropGrad.apply(self.dense(x), self.dqweight).pow(2).mean() + self.empty(x).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    # bf16 fills the JSON's "bf16": {"enabled": "auto"}; the plugin reads everything else from the launch.
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=SafeDeepSpeedPlugin())
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    batch = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(batch.repeat(args.steps * accelerator.num_processes, 1), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)

    losses = []
    for x in data:
        loss = model(x.to(torch.bfloat16))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.float().item())

    report = model.safe_zero_session.report  # the engine safe_zero built keeps what its fixes did
    # One write, newline included: the ranks share one pipe, and print() writes text and newline apart.
    print(f"[rank {accelerator.process_index}/{accelerator.num_processes}] "
          f"ZeRO-{accelerator.state.deepspeed_plugin.zero_stage} losses: {' '.join(f'{v:.4f}' for v in losses)}; "
          f"safe_zero engaged: {', '.join(sorted(report)) or 'none'}\n", end="", flush=True)
    accelerator.end_training()  # waits for every process and tears the process group down


if __name__ == "__main__":
    main()
    # A gloo thread torn down during interpreter finalization can abort a 2-process CPU run after training finished
    # ("terminate called without an active exception"): leave without finalization, output flushed.
    sys.stdout.flush()
    os._exit(0)
