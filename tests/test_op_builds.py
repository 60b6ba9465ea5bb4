"""JIT build locks: a build in progress is waited for with a word, a lock a killed build left is named instead of
every process waiting on it forever, and a lock file no build holds (torch >= 2.14 keeps it) is nothing to do.

torch <= 2.13 takes a ``FileBaton`` (the file's existence is the lock), torch >= 2.14 an advisory lock on the same
file. The first two tests run torch's own JIT lock, whichever kind the installed torch takes; the rest hold each kind
by hand with the detection set to it, so both kinds are checked on any torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest
from torch.utils import cpp_extension

from safe_zero import op_builds
from safe_zero.op_builds import (STALE_AFTER_S, LockState, StaleBuildLockError, build_directory, check_op_build,
                                 lock_is_advisory, lock_state)

OP = "deepspeed_shm_comm"  # the CPU comm op every CPU process group loads
OLD = STALE_AFTER_S + 60


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """An empty torch extensions cache; returns the comm op's build directory in it."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = build_directory(OP)
    assert os.path.dirname(directory) == str(tmp_path)
    return directory


@pytest.fixture(params=["baton", "advisory"])
def kind(request, monkeypatch) -> str:
    """Which lock torch's JIT build takes, as op_builds reads it."""
    monkeypatch.setattr(op_builds, "lock_is_advisory", lambda: request.param == "advisory")
    return request.param


def _age(path: str, age_s: float) -> None:
    then = time.time() - age_s
    os.utime(path, (then, then))


def _lock(directory: str, age_s: float) -> str:
    lock = os.path.join(directory, "lock")
    open(lock, "w").close()
    _age(lock, age_s)
    return lock


def _until_printed(process: subprocess.Popen, line: str) -> None:
    assert process.stdout is not None
    got = process.stdout.readline()
    assert got == line + "\n", f"{got!r}; stderr: {process.stderr.read() if process.poll() is not None else ''}"


@contextlib.contextmanager
def _advisory_lock_held_elsewhere(lock: str) -> Iterator[None]:
    """``lock`` held by another process as torch >= 2.14's build holds it (filelock), until the block ends."""
    code = ("import sys, time\nfrom filelock import FileLock\nheld = FileLock(sys.argv[1])\nheld.acquire()\n"
            "print('held', flush=True)\ntime.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, lock], stdout=subprocess.PIPE, text=True)
    try:
        _until_printed(holder, "held")
        yield
    finally:
        holder.kill()
        holder.wait()


# torch's JIT load with the compiler and the import stubbed out: it takes its lock and "builds" inside it.
_JIT_BUILD = """
import sys, time
from torch.utils import cpp_extension

def build(**kwargs):
    print("building", flush=True)
    time.sleep(600)

cpp_extension._write_ninja_file_and_build_library = build
cpp_extension.load("safe_zero_lock_probe", [sys.argv[1]], build_directory=sys.argv[2])
"""


def _source(tmp_path) -> str:
    source = tmp_path / "probe.cpp"
    source.write_text("int probe() { return 0; }\n")
    return str(source)


def test_the_lock_torch_builds_under_is_read_as_a_build_and_released_as_free(tmp_path, monkeypatch):
    directory = tmp_path / "build"
    directory.mkdir()
    lock = str(directory / "lock")
    seen = []
    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_build_library",
                        lambda **kwargs: seen.append(lock_state(str(directory))))
    monkeypatch.setattr(cpp_extension, "_import_module_from_library", lambda *args: None)
    cpp_extension.load(f"safe_zero_lock_probe_{os.getpid()}", [_source(tmp_path)], build_directory=str(directory))
    assert seen == [LockState.HELD]
    # torch >= 2.14 leaves the file after every build; a FileBaton is removed on release. Either way: free.
    assert os.path.exists(lock) is lock_is_advisory()
    if os.path.exists(lock):
        _age(lock, OLD)
    assert lock_state(str(directory)) is LockState.FREE


def test_a_build_killed_half_way_leaves_a_stale_lock_only_where_the_file_is_the_lock(tmp_path):
    directory = tmp_path / "build"
    directory.mkdir()
    lock = str(directory / "lock")
    builder = subprocess.Popen([sys.executable, "-c", _JIT_BUILD, _source(tmp_path), str(directory)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _until_printed(builder, "building")
        assert lock_state(str(directory)) is LockState.HELD
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait()
    assert os.path.exists(lock)  # both kinds leave the file: only its meaning differs
    _age(lock, OLD)
    assert lock_state(str(directory)) is (LockState.FREE if lock_is_advisory() else LockState.STALE)


def test_a_held_advisory_lock_is_a_build_in_progress_and_a_released_one_is_free(extensions, monkeypatch):
    monkeypatch.setattr(op_builds, "lock_is_advisory", lambda: True)
    said: list[str] = []
    lock = _lock(extensions, OLD)  # the file every finished build leaves, however old
    with _advisory_lock_held_elsewhere(lock):
        assert lock_state(extensions) is LockState.HELD
        check_op_build(say=said.append)
    assert len(said) == 1 and said[0].startswith("waiting for another process building DeepSpeed's"), said
    # Released (its holder died): nothing waits on the file, and the op is built as in an empty cache.
    assert lock_state(extensions) is LockState.FREE
    said.clear()
    check_op_build(say=said.append)
    assert len(said) == 1 and said[0].startswith("building DeepSpeed's"), said
    open(os.path.join(extensions, f"{OP}.so"), "w").close()
    said.clear()
    check_op_build(say=said.append)
    assert said == []


def test_an_old_baton_with_no_build_running_is_named(extensions, monkeypatch):
    monkeypatch.setattr(op_builds, "lock_is_advisory", lambda: False)
    lock = _lock(extensions, OLD)
    assert lock_state(extensions) is LockState.STALE
    with pytest.raises(StaleBuildLockError, match=f"Delete it \\(rm {lock}\\)"):
        check_op_build()


def test_a_baton_of_a_running_build_is_waited_for_with_a_word(extensions, monkeypatch):
    monkeypatch.setattr(op_builds, "lock_is_advisory", lambda: False)
    said: list[str] = []
    _lock(extensions, 1)
    check_op_build(say=said.append)
    assert len(said) == 1 and said[0].startswith("waiting for another process building DeepSpeed's")

    # An old baton while something works in the build directory (ninja does): a slow build, not a stale lock.
    _lock(extensions, OLD)
    builder = subprocess.Popen(["sleep", "30"], cwd=extensions)
    try:
        assert lock_state(extensions) is LockState.HELD
    finally:
        builder.kill()
        builder.wait()
    assert lock_state(extensions) is LockState.STALE


def test_a_build_is_announced_and_a_finished_one_is_not(extensions, kind):
    said: list[str] = []
    check_op_build(say=said.append)
    assert len(said) == 1 and "building DeepSpeed's" in said[0] and "about a minute" in said[0]
    open(os.path.join(extensions, f"{OP}.so"), "w").close()
    if kind == "advisory":
        _lock(extensions, OLD)  # a finished build keeps it
    said.clear()
    check_op_build(say=said.append)
    assert said == []


def test_the_rig_refuses_a_stale_lock_before_starting_ranks(extensions, monkeypatch):
    from rig import DistPool

    monkeypatch.setattr(op_builds, "lock_is_advisory", lambda: False)
    _lock(extensions, OLD)
    with pytest.raises(StaleBuildLockError):
        DistPool(2)
