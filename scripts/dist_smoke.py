"""``make dist``'s check of the installed wheel, run by the fresh venv it went into, from outside the checkout.

1. safe_zero is imported from that venv's site-packages, and the installed distribution holds every file git tracks
   under ``safe_zero/`` (modules, subpackages, ``py.typed``), at the version ``safe_zero.__version__`` says.
2. One ZeRO-3 step on 2 CPU ranks (gloo) through ``safe_zero.initialize``, on a model with a zero-element and a
   gradient-less trainable parameter (both crash stock ZeRO-3): the loss on the same batch changes.

    python scripts/dist_smoke.py CHECKOUT
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import sysconfig


def check_installed(checkout: str) -> None:
    import safe_zero

    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    where = os.path.realpath(safe_zero.__file__)
    if not where.startswith(site + os.sep):
        raise SystemExit(f"safe_zero was imported from {where}, not from this venv's site-packages {site}")
    tracked = set(subprocess.run(["git", "-C", checkout, "ls-files", "safe_zero"], capture_output=True, text=True,
                                 check=True).stdout.split())
    installed = {str(f) for f in importlib.metadata.files("safe-zero") or () if str(f).startswith("safe_zero/")}
    missing = sorted(f for f in tracked if f not in installed)
    if missing:
        raise SystemExit(f"the wheel lacks {len(missing)} file(s) git tracks under safe_zero/: {missing}")
    metadata_version = importlib.metadata.version("safe-zero")
    if metadata_version != safe_zero.__version__:
        raise SystemExit(f"the wheel's metadata says {metadata_version}, safe_zero.__version__ {safe_zero.__version__}")
    print(f"installed: safe_zero {metadata_version} from {os.path.dirname(where)}, {len(tracked)} tracked files")


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    import safe_zero

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)
            self.placeholder = nn.Parameter(torch.zeros(0, 8))  # zero-element, trainable
            self.unused = nn.Parameter(torch.ones(8))  # trainable, never gets a gradient

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).pow(2).mean()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3}}
    model = Model()
    engine, *_ = safe_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    batch = torch.ones(1, 8)
    before = engine(batch)
    engine.backward(before)
    engine.step()
    after = engine(batch).item()
    results.put((rank, before.item(), after))
    # Tear gloo down before interpreter exit: its threads abort the process in finalization otherwise.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def train_two_ranks() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    if codes != [0, 0]:
        raise SystemExit(f"the 2-rank ZeRO-3 step failed (exit codes by rank: {codes})")
    losses = sorted(results.get(timeout=10) for _ in procs)
    if any(before == after for _, before, after in losses):
        raise SystemExit(f"the ZeRO-3 step did not change the loss: {losses}")
    print(f"2-rank ZeRO-3 step: loss before, after by rank: {losses}")


if __name__ == "__main__":
    check_installed(os.path.abspath(sys.argv[1]))
    train_two_ranks()
