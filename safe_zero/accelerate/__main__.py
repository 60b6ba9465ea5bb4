"""Run a training script with safe_zero's Accelerate routing bound, without editing the script.

    accelerate launch --config_file examples/accelerate/zero3.yaml -m safe_zero.accelerate train.py --lr 1e-4

runs ``train.py --lr 1e-4`` as ``__main__`` in every process after ``import safe_zero.accelerate``,
so its ``deepspeed.initialize`` goes through safe_zero when the DeepSpeed config has a
``"safe_zero"`` block (and stays stock otherwise, with a rank-0 warning). On a host without an
accelerator it also sets up Accelerate's process state with gloo
(:func:`safe_zero.accelerate.cpu_distributed_state`), as ``SafeDeepSpeedPlugin`` does.
"""

from __future__ import annotations

import os
import runpy
import sys

import safe_zero.accelerate


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    safe_zero.accelerate.install_on_request()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":  # set by `accelerate launch`
        safe_zero.accelerate.cpu_distributed_state()
    sys.argv = list(argv)
    # As `python train.py` would: the script's folder first on the import path.
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
