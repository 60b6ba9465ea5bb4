"""A JIT build lock that a killed build left behind is named, instead of every process waiting on it forever."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from safe_zero.op_builds import STALE_AFTER_S, StaleBuildLockError, build_directory, check_op_build, stale_lock

OP = "deepspeed_shm_comm"  # the CPU comm op every CPU process group loads


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """An empty torch extensions cache; returns the comm op's build directory in it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = build_directory(OP)
    assert os.path.dirname(directory) == str(tmp_path)
    return directory


def _lock(directory: str, age_s: float) -> str:
    lock = os.path.join(directory, "lock")
    open(lock, "w").close()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_an_old_lock_with_no_build_running_is_named(extensions):
    lock = _lock(extensions, STALE_AFTER_S + 60)
    with pytest.raises(StaleBuildLockError, match=f"Delete it \\(rm {lock}\\)"):
        check_op_build()


def test_a_lock_of_a_running_build_is_waited_for_with_a_word(extensions):
    said = []
    _lock(extensions, 1)
    check_op_build(say=said.append)
    assert len(said) == 1 and said[0].startswith("waiting for another process building DeepSpeed's")

    # An old lock while something works in the build directory (ninja does): a slow build, not a stale lock.
    lock = _lock(extensions, STALE_AFTER_S + 60)
    builder = subprocess.Popen(["sleep", "30"], cwd=extensions)
    try:
        assert stale_lock(extensions) is None
    finally:
        builder.kill()
        builder.wait()
    assert stale_lock(extensions) == lock


def test_a_build_is_announced_and_a_finished_one_is_not(extensions):
    said = []
    check_op_build(say=said.append)
    assert len(said) == 1 and "building DeepSpeed's" in said[0] and "about a minute" in said[0]
    open(os.path.join(extensions, f"{OP}.so"), "w").close()
    said.clear()
    check_op_build(say=said.append)
    assert said == []


def test_the_rig_refuses_a_stale_lock_before_starting_ranks(extensions):
    from tests.rig import DistPool

    _lock(extensions, STALE_AFTER_S + 60)
    with pytest.raises(StaleBuildLockError):
        DistPool(2)
