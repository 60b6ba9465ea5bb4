#!/usr/bin/env bash
# GPU checks that CPU CI cannot run (< 5 minutes on one GPU): fp16 stage 0 with a zero-sized
# parameter, the real ZeRO-3 CUDA quantizer with a frozen zero-sized parameter, and a grouped_mm
# MoE step under stock vs safe ZeRO-2. Run from the repo root on a machine with CUDA torch + DeepSpeed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
for check in benchmarks/gpu/*.py; do
    echo "== $check"
    timeout 120 python "$check" || status=1
done
exit $status
