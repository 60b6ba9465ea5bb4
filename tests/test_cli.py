"""``python -m safe_zero demo`` and ``doctor`` as a user runs them."""

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from filelock import FileLock

from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import flat_buffer_autograd, zero_element_groups
from safe_zero.op_builds import STALE_AFTER_S, build_directory, lock_is_advisory
from safe_zero.versions import SUPPORTED
from tests.support.bodies import HOOK_RUNS_WITHOUT_A_GRADIENT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: int = 300, **environ: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(environ)
    return subprocess.run([sys.executable, "-m", "safe_zero", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_shows_stock_failing_and_safe_zero_training():
    result = _run("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    stock = [line for line in lines if line.startswith("ZeRO-") and " stock " in line]
    safe = [line for line in lines if line.startswith("ZeRO-") and " safe_zero " in line]
    assert len(stock) == 2 and all("FAILS" in line for line in stock), result.stdout
    assert len(safe) == 2 and all(" trains " in line for line in safe), result.stdout
    assert all(line.rstrip().endswith("data_ptr % 16 = 0") for line in safe), result.stdout
    assert "safe_zero trained every configuration." in lines


def test_doctor_probes_agree_with_the_declared_versions_and_reads_a_model():
    result = _run("doctor", "--json", "tests.support.models:ZeroSized")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    deepspeed_row = report["versions"]["deepspeed"]
    assert deepspeed_row["installed"] == str(DEEPSPEED_VERSION)
    assert deepspeed_row["status"] in ("tested", "within the tested range"), deepspeed_row
    torch_row = report["versions"]["torch"]
    # The floor leg is green at torch's floor (docs/versions.md): doctor calls it tested.
    assert torch_row["tested_floor"] == SUPPORTED["torch"].floor == "2.4.1"
    assert (torch_row["tested_ci"], torch_row["tested_newest"], torch_row["newest_green_on"],
            torch_row["spot_checked"]) == (SUPPORTED["torch"].ci, SUPPORTED["torch"].newest,
                                           SUPPORTED["torch"].newest_green_on, list(SUPPORTED["torch"].spot_checked))
    fixes = report["fixes"]
    # Every release has these three; the probes must find them (stock stops on a grad-less parameter only where
    # torch runs its hook without a gradient: not on torch 2.4/2.5).
    assert fixes["zero3_zero_element_params"]["defect_present"] is True
    assert fixes["gradless_params"]["defect_present"] is HOOK_RUNS_WITHOUT_A_GRADIENT
    assert fixes["grouped_mm_alignment"]["defect_present"] is True
    # These two are version-bound: the probe, the declared range and the switch must agree.
    for fix in (zero_element_groups.FIX, flat_buffer_autograd.FIX):
        needed = fix.needed(DEEPSPEED_VERSION)
        assert fixes[fix.name]["defect_present"] is needed, fix.name
        assert fixes[fix.name]["engages"] is needed, fix.name
    assert report["model"]["zero_sized"] == {"empty.weight": [0, 8]}
    assert report["model"]["gradless"] is None  # a plain factory model has no dummy inputs to probe with


@pytest.mark.main_leg_only
def test_doctor_json_is_stdout_alone_while_deepspeed_builds_its_op(tmp_path):
    # An extensions cache without the op's library: DeepSpeed builds its CPU comm op and prints that on stdout itself.
    # The session's compiled objects come along, so the build is a relink, not the ~35 s compile of an empty cache:
    # the same load, ninja run and output.
    warm = build_directory("deepspeed_shm_comm")
    shutil.copytree(warm, tmp_path / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("*.so", "lock"))
    result = _run("doctor", "--json", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert glob.glob(str(tmp_path / "deepspeed_shm_comm" / "*.so")), "DeepSpeed did not build its op"
    assert "safe_zero: building DeepSpeed's deepspeed.ops.comm.deepspeed_shm_comm_op" in result.stderr
    report = json.loads(result.stdout)  # stdout is the JSON alone
    assert report["versions"]["deepspeed"]["installed"] == str(DEEPSPEED_VERSION)


def _unreleased_lock(root, age_s: float) -> str:
    os.makedirs(root / "deepspeed_shm_comm", exist_ok=True)
    lock = str(root / "deepspeed_shm_comm" / "lock")
    open(lock, "w").close()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


@pytest.mark.main_leg_only
def test_doctor_checks_its_argument_before_anything_waits(tmp_path):
    # A build lock nobody releases: a doctor that ran its probes first would wait on it until the timeout.
    # torch <= 2.13: the file is the lock; torch >= 2.14: a process holds an advisory lock on it (this one).
    lock = _unreleased_lock(tmp_path, 0)
    with FileLock(lock) if lock_is_advisory() else contextlib.nullcontext():
        start = time.monotonic()
        result = _run("doctor", "/nonexistent/model", timeout=120, TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert result.returncode != 0
    assert "'/nonexistent/model' does not exist" in result.stderr, result.stderr
    assert time.monotonic() - start < 60


@pytest.mark.main_leg_only
@pytest.mark.parametrize("command", ["doctor", "demo"])
def test_an_old_build_lock_no_build_holds(tmp_path, command):
    # The op built (its library copied from the session's cache), and its lock file left 6 minutes ago. torch <= 2.13
    # keeps that file only when a build was killed: it is named instead of waited on. torch >= 2.14 keeps it after
    # every build and the lock is free: nothing to say, and the command runs.
    warm = build_directory("deepspeed_shm_comm")
    shutil.copytree(warm, tmp_path / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    lock = _unreleased_lock(tmp_path, STALE_AFTER_S + 60)
    result = _run(command, timeout=300, TORCH_EXTENSIONS_DIR=str(tmp_path))
    if lock_is_advisory():
        assert result.returncode == 0, result.stderr
        assert not any(word in result.stderr for word in ("Delete it", "waiting for", "building DeepSpeed's")), \
            result.stderr
    else:
        assert result.returncode == 1
        assert f"Delete it (rm {lock}) and run again" in result.stderr, result.stderr
