#!/usr/bin/env bash
# The GPU-only checks (benchmarks/gpu/check.py): each asserts the stock DeepSpeed defect and the safe_zero result,
# at 1 and 2 NCCL ranks, and writes a JSON report (--report PATH, else $OUT/gpu_check_report.json, else
# benchmarks/gpu/report.json). Exit 0: nothing failed (skips listed); 1: a check failed; 2: no CUDA, nothing ran.
# Run from anywhere on a machine with CUDA torch, DeepSpeed and nvcc (DeepSpeed JIT-builds fused_adam and its
# quantizer): benchmarks/gpu_check.sh [--only CHECK ...] [--report PATH] [--budget SECONDS]; --list prints the checks.
# PYTHON selects the interpreter (default: .venv/bin/python if there is one, else python3); on a GPU machine whose
# .venv holds the CPU torch of `make`, point it at the interpreter with CUDA torch: PYTHON=python3 benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
unset DS_ACCELERATOR  # a CPU run's DS_ACCELERATOR=cpu would keep DeepSpeed off the GPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" benchmarks/gpu/check.py "$@"
