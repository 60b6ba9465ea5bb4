"""Two CPU processes through Lightning's own launcher; run by test_strategy.py, not collected by pytest.

    python tests/lightning/two_devices.py TMPDIR CASE [CASE ...]    CASE = trainer:<strategy> | fabric:<strategy>

The first Trainer/Fabric re-executes this script for rank 1 (Lightning's subprocess launcher), so
the ``safe_`` names must come from ``import safe_zero`` in the re-executed process too. The later
cases run in the same two processes. Each rank prints one ``SAFE_ZERO_RESULT {json}`` line per
case, or ``SAFE_ZERO_ERROR {json}`` and exits 1.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import safe_zero  # noqa: E402,F401  (before Lightning: registers the safe_ names once it is imported)
import torch.distributed as dist  # noqa: E402

from tests.lightning import cases  # noqa: E402

DEVICES = 2


def _emit(marker: str, payload: dict) -> None:
    # Both ranks share one pipe: one write() per line (atomic below PIPE_BUF), starting on a fresh line.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"\n{marker} {json.dumps(payload)}\n".encode())


def main() -> None:
    tmp, *todo = sys.argv[1:]
    for case in todo:
        kind, strategy = case.split(":")
        run = {"trainer": cases.trainer_fits, "fabric": cases.fabric_fits}[kind]
        try:
            result = run(strategy, DEVICES, tmp)
        except BaseException as e:  # reported on this rank's line; the other rank may wait in a collective
            error = {"case": case, "local_rank": os.environ.get("LOCAL_RANK"), "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()}
            _emit("SAFE_ZERO_ERROR", error)
            os._exit(1)
        _emit("SAFE_ZERO_RESULT", {"case": case, **result})
    # gloo's threads abort the process if torn down during interpreter finalization.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
