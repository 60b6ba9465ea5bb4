"""``python -m tests.gpu [--report PATH] [pytest arguments]``: the GPU checks (``tests/gpu/test_gpu.py``) on CUDA.

Where torch sees no GPU it prints ``no CUDA: skipped``, writes a report saying so and exits 2. Otherwise it runs the
tests marked ``gpu`` with ``DS_ACCELERATOR=cuda`` and exits with pytest's status (0: nothing failed, skips
allowed; 1: a check failed). The JSON report (``--report``, else ``$OUT/gpu_check_report.json``, else
``.bench/gpu_check_report.json``) gives each check's outcome, seconds, its legs' records and its failure; pytest's
junit XML lies beside it. Needs CUDA torch, DeepSpeed and nvcc (DeepSpeed JIT-builds fused_adam and its quantizer).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_CUDA_EXIT = 2


def report_path(arg: str | None, environ: dict) -> str:
    """``--report``, else ``$OUT/gpu_check_report.json`` where ``$OUT`` is set, else in ``.bench/``."""
    if arg:
        return os.path.abspath(arg)
    return os.path.join(os.path.abspath(environ.get("OUT") or os.path.join(ROOT, ".bench")), "gpu_check_report.json")


def arch_list_for_deepspeed(arch_list: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` without the arch-specific suffixes (``9.0a`` -> ``9.0``) DeepSpeed's JIT builder
    cannot parse (0.19.8: ``int('0a')`` raises in ``compute_capability_args``, so every build fails). Hopper images
    set ``9.0a``; the ops built here use none of its arch-specific instructions."""
    return re.sub(r"(\d+\.\d+)[a-z]\b", r"\1", arch_list)


def gpu_env(report: str, environ: dict) -> dict:
    """The environment the checks run in: DeepSpeed on CUDA, an arch list it parses, the report's path."""
    env = dict(environ, DS_ACCELERATOR="cuda", SAFE_ZERO_GPU_REPORT=report, PYTHONUNBUFFERED="1")
    if env.get("TORCH_CUDA_ARCH_LIST"):
        env["TORCH_CUDA_ARCH_LIST"] = arch_list_for_deepspeed(env["TORCH_CUDA_ARCH_LIST"])
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("NCCL_DEBUG", "WARN")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="the JSON report's path")
    args, pytest_args = parser.parse_known_args(argv)
    path = report_path(args.report, dict(os.environ))
    import torch

    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} in {sys.executable} is a CPU build: run it with an interpreter with CUDA "
               "torch" if torch.version.cuda is None else f"torch {torch.__version__} sees no GPU")
        print(f"no CUDA: skipped ({why})", flush=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"status": "skipped", "reason": f"no CUDA: {why}", "tests": []}, f, indent=2)
        return NO_CUDA_EXIT
    print(f"safe_zero GPU checks on {torch.cuda.device_count()} GPU(s); report {path}", flush=True)
    command = [sys.executable, "-m", "pytest", "tests/gpu/test_gpu.py", "-m", "gpu", "-v", "-p", "no:cacheprovider",
               f"--junitxml={os.path.splitext(path)[0]}.xml", *pytest_args]
    return subprocess.run(command, cwd=ROOT, env=gpu_env(path, dict(os.environ))).returncode


if __name__ == "__main__":
    sys.exit(main())
