"""The GPU checks' fixtures (NCCL rank pools, DeepSpeed's JIT ops), their skip without CUDA, and the JSON report.

Tests marked ``gpu`` run only where torch sees CUDA and ``DS_ACCELERATOR`` is not ``cpu`` (``python -m tests.gpu``
sets it to ``cuda``; the suite's conftest defaults it to ``cpu``), else they are skipped. Where
``$SAFE_ZERO_GPU_REPORT`` names a file, each test's outcome, seconds, recorded properties (its legs' records) and
failure go there as JSON at the end of the session.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import pytest

from rig import Pools

#: DeepSpeed op builder of each JIT op a check loads, and how long its build may take.
OPS = {"fused_adam": "FusedAdamBuilder", "quantizer": "QuantizerBuilder"}
BUILD_TIMEOUT_S = 420
_REPORT: list[dict] = []
_STARTED = time.time()


def cuda_ready() -> bool:
    import torch

    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"


def pytest_collection_modifyitems(config, items):
    if not cuda_ready():
        skip = pytest.mark.skip(reason="needs CUDA: python -m tests.gpu (benchmarks/gpu_check.sh)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_ranks():
    """``gpu_ranks(world_size).run(body, **kwargs)`` runs a module-level body on NCCL ranks, rank r on GPU r."""
    pools = Pools(backend="nccl")
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def jit_op():
    """``jit_op(name)`` builds (or finds built) DeepSpeed's ``fused_adam`` or ``quantizer`` in a process of its own,
    with a timeout, once a session; the test fails with the build's output where it does not build."""
    failed: dict[str, str | None] = {}

    def build(op: str) -> None:
        if op not in failed:
            code = ("from safe_zero.op_builds import check_op_build; "
                    "from deepspeed.accelerator import get_accelerator; "
                    f"check_op_build({OPS[op]!r}, say=print); get_accelerator().create_op_builder({OPS[op]!r}).load()")
            try:
                done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      timeout=BUILD_TIMEOUT_S)
                failed[op] = None if done.returncode == 0 else (done.stdout + done.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                failed[op] = f"timed out after {BUILD_TIMEOUT_S} s"
        if failed[op]:
            pytest.fail(f"DeepSpeed's {op} JIT build failed (nvcc needed): {failed[op]}")

    return build


def pytest_runtest_logreport(report):
    if os.environ.get("SAFE_ZERO_GPU_REPORT") and (report.when == "call" or not report.passed):
        _REPORT.append({"test": report.nodeid.rpartition("::")[2], "outcome": report.outcome,
                        "seconds": round(report.duration, 1), "records": dict(report.user_properties),
                        "failure": str(report.longrepr)[-4000:] if report.longrepr else None})


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("SAFE_ZERO_GPU_REPORT")
    if not path:
        return
    import deepspeed
    import torch

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    report = {"status": "fail" if any(t["outcome"] == "failed" for t in _REPORT) else "pass",
              "started": datetime.datetime.fromtimestamp(_STARTED).isoformat(timespec="seconds"),
              "seconds": round(time.time() - _STARTED, 1),
              "environment": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                              "deepspeed": deepspeed.__version__, "devices": devices,
                              "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST")},
              "tests": _REPORT}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
