#!/usr/bin/env bash
# What a GPU machine runs: the GPU checks (tests/gpu/test_gpu.py, through `python -m tests.gpu`), each asserting the
# stock DeepSpeed defect and the safe_zero result at 1 and 2 NCCL ranks, with a JSON report (--report PATH, else
# $OUT/gpu_check_report.json, else .bench/gpu_check_report.json). Exit 0: nothing failed (skips listed); 1: a check
# failed; 2: no CUDA, nothing ran. Further arguments go to pytest (-k grouped_mm runs some of them).
# Needs CUDA torch, DeepSpeed and nvcc (DeepSpeed JIT-builds fused_adam and its quantizer). PYTHON selects the
# interpreter (default: .venv/bin/python if there is one, else python3); on a GPU machine whose .venv holds the CPU
# torch of `make`, point it at the interpreter with CUDA torch: PYTHON=python3 benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -m tests.gpu "$@"
