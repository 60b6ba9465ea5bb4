"""What the GPU checks share: a one-rank process group's environment and the RESULT lines they print."""

from __future__ import annotations

import os

RESULTS: dict[str, bool] = {}


def single_rank_env(port: int) -> None:
    """Rank 0 of 1 on ``port`` unless a launcher set the variables (each check its own port, so they can overlap)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS[name] = ok
    print(f"RESULT {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
