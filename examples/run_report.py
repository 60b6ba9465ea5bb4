"""What the HF Trainer examples print when training ends, and how their processes leave: shared by the scripts.

Nothing here is needed by safe_zero. Each rank prints ``[TAG rank R/W] ZeRO-S losses: ...; safe_zero engaged:
...`` (the line the tests read), rank 0 then the report of what safe_zero did.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn


def report_trainer_run(tag: str, trainer: Any) -> None:
    """Print ``trainer``'s logged losses and its engine's safe_zero report."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    report = engine.safe_zero_session.report
    rank, world = trainer.args.process_index, trainer.args.world_size
    # One write, newline included: the ranks share one pipe, and print() writes text and newline apart.
    print(f"[{tag} rank {rank}/{world}] ZeRO-{engine.zero_optimization_stage()} losses: "
          f"{' '.join(f'{v:.4f}' for v in losses)}; safe_zero engaged: {', '.join(sorted(report)) or 'none'}\n",
          end="", flush=True)
    if rank == 0:
        for name, what in report.items():
            print(f"  {name}: {'; '.join(sorted(set(what)))}", flush=True)


def leave() -> NoReturn:
    """End the process once every rank is here, without interpreter finalization: a gloo thread torn down then can
    abort a several-process CPU run after training finished (REFERENCE: "terminate called without an active
    exception")."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
