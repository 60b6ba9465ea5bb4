"""Training script that ``tests/accelerate/test_accelerate_launch.py`` runs under ``accelerate launch``.

A plain Accelerate script (with the CPU process-group line a stock user needs). It first trains
with stock DeepSpeed and records the error, then does ``import safe_zero.accelerate`` (the
config-file route: the JSON's "safe_zero" block opts in) and trains a fresh model on the same
Accelerator. Each rank prints ``RESULT <json>`` lines that the test checks.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

from safe_zero.probes import DropGrad

STEPS = 4


class ZeroSizedAndGradless(nn.Module):
    """A zero-sized parameter (``nn.Linear(8, 0)``), a trainable parameter that never gets a gradient,
    and a 3-D experts weight that a grouped matmul reads, placed off the 16-byte grid by ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.empty = nn.Linear(8, 0, bias=False)
        self.dqweight = nn.Parameter(torch.full((4, 8), 0.125))
        self.scale = nn.Parameter(torch.ones(3))  # 6 bf16 bytes: the experts weight starts off the 16-byte grid
        self.experts = nn.Parameter(torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(2)) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        moe = torch.einsum("bi,eio->beo", h, self.experts)
        return (DropGrad.apply(h, self.dqweight).pow(2).mean() + moe.pow(2).mean()
                + (h[:, :3] * self.scale).pow(2).mean() + self.empty(x).sum())


def emit(**fields) -> None:
    # One write per line: the ranks share the launcher's stdout, and print() writes the newline apart.
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def train(accelerator, phase: str) -> None:
    import deepspeed

    import safe_zero

    torch.manual_seed(0)
    model = safe_zero.mark_grouped_mm(ZeroSizedAndGradless())
    dq_before = model.dqweight.detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    # Every batch is the same two rows, on every rank: the loss must fall step after step.
    batch = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(batch.repeat(STEPS * accelerator.num_processes, 1), batch_size=2)
    rank = accelerator.process_index
    stage = accelerator.state.deepspeed_plugin.zero_stage
    losses: list[float] = []
    experts_offset = None  # ZeRO-2 only: there the experts weight is a view into the flat bf16 buffer
    try:
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
        if stage == 2:
            experts_offset = model.module.experts.data_ptr() % 16
        for x in data:
            loss = model(x.to(torch.bfloat16))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.float().item())
    except Exception as e:  # the stock run's error is the result
        emit(phase=phase, rank=rank, error=f"{type(e).__name__}: {e}".splitlines()[0][:400], losses=losses,
             experts_offset=experts_offset)
        return
    module = model.module
    params = [module.empty.weight, module.dqweight]
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        empty_shape = list(module.empty.weight.shape)
        dq_unchanged = torch.equal(module.dqweight.detach().float(), dq_before.to(torch.bfloat16).float())
    session = getattr(model, "safe_zero_session", None)
    emit(phase=phase, rank=rank, error=None, losses=losses, stage=stage, world=accelerator.num_processes,
         experts_offset=experts_offset, experts_offset_after=module.experts.data_ptr() % 16 if stage == 2 else None,
         empty_shape=empty_shape, dq_unchanged=dq_unchanged,
         safe=session is not None, engaged=sorted(session.report) if session else [],
         request="safe_zero" in accelerator.state.deepspeed_plugin.deepspeed_config)


def main() -> None:
    from accelerate import Accelerator, DeepSpeedPlugin, PartialState

    PartialState(backend="gloo")  # what a stock Accelerate script needs on a CPU host
    # The plugin the launch describes (--config_file), as Accelerator() builds it itself; given explicitly because
    # Accelerate 1.9 builds it only when no process state exists yet, and otherwise fails on the state above.
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin())
    train(accelerator, "stock")
    import safe_zero.accelerate  # noqa: F401  the config-file route: the JSON's "safe_zero" block opts in

    # One Accelerator, a second model: point accelerator.backward at the new engine.
    accelerator.deepspeed_engine_wrapped = None
    train(accelerator, "safe")

    # A 2-process gloo run can abort in interpreter finalization after training finished (a gloo thread torn down
    # during finalization).
    import torch.distributed as dist

    accelerator.wait_for_everyone()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
