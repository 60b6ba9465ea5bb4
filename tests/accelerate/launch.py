"""Run ``accelerate launch`` in a subprocess and collect each rank's ``RESULT <json>`` lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "accelerate"


def accelerate_launch(*args: str, timeout: float = 420) -> tuple[list[dict], str]:
    """``accelerate launch <args>`` from the repository root; returns (RESULT records, the whole output).

    Raises ``AssertionError`` with the output's tail when the launch times out or exits non-zero.
    """
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=path, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, "-m", "accelerate.commands.launch", *args]
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"`accelerate launch {' '.join(args)}` timed out after {timeout}s:\n{output[-4000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`accelerate launch {' '.join(args)}` exited {proc.returncode}:\n{output[-6000:]}"
    return results(proc.stdout), output


def results(stdout: str) -> list[dict]:
    """Every ``RESULT <json>`` record in ``stdout``, wherever it starts: a rank's one-write line can land in the
    middle of another rank's line (Trainer's log ``print`` writes its newline apart)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(stdout, m.end())[0] for m in re.finditer(r"RESULT (?=\{)", stdout)]


def by_phase(records: list[dict], phase: str, world: int) -> list[dict]:
    """The records of one phase, one per rank, sorted by rank; asserts every rank reported."""
    found = sorted((r for r in records if r["phase"] == phase), key=lambda r: r["rank"])
    assert [r["rank"] for r in found] == list(range(world)), f"phase {phase!r}: ranks reported {found}"
    return found
