"""DeepSpeed's JIT-built ops: say when a build starts, and find a build lock that nothing will release.

On first use DeepSpeed compiles its CPU ops (the shared-memory comm op that every CPU process group
loads) into the torch extensions cache, under ``lock`` in the op's build directory. What that file
means depends on torch:

- torch <= 2.13 takes a ``FileBaton``: the file's existence is the lock. Every later process, also one
  that only loads the finished build, waits while it exists; a build killed half-way leaves it behind,
  and from then on every process waits forever, without a word.
- torch >= 2.14 takes an OS-level advisory lock on it through ``filelock`` (pytorch#189245): the file
  stays after every build, and the kernel releases the lock when its holder dies, so no lock is stale.

:func:`check_op_build` runs before the op is loaded: it says when a build is about to start or another
process's build is waited for, and raises :class:`StaleBuildLockError`, naming the file to delete, for a
``FileBaton`` that no build holds.
"""

from __future__ import annotations

import enum
import glob
import os
import sys
import time
from typing import Callable

from filelock import FileLock, Timeout
from torch.utils import cpp_extension

from safe_zero.errors import StaleBuildLockError  # noqa: F401  (re-exported)

#: A ``FileBaton`` older than this, with no build process in its directory, was left by a killed build.
STALE_AFTER_S = 300.0
#: What a first build of the CPU comm op costs (measured: ~60 s on 2 shared cores).
TYPICAL_BUILD = "about a minute on 2 CPU cores"
#: The op every CPU process group loads (``deepspeed.comm.torch.build_shm_op``).
SHM_COMM_BUILDER = "ShareMemCommBuilder"


class LockState(enum.Enum):
    """What the build lock in an op's build directory means for a process about to load the op."""

    FREE = "free"  #: no lock, or a file no build holds (torch >= 2.14 keeps it after every build): loads at once
    HELD = "held"  #: a build is in progress: loading waits for it
    STALE = "stale"  #: a ``FileBaton`` a killed build left: loading would wait forever


def _say(message: str) -> None:
    print(f"safe_zero: {message}", file=sys.stderr, flush=True)


def build_directory(op_name: str) -> str:
    """Where torch builds (and DeepSpeed loads) the JIT op ``op_name``: ``$TORCH_EXTENSIONS_DIR/<op_name>``."""
    return cpp_extension._get_build_directory(op_name, verbose=False)


def lock_is_advisory() -> bool:
    """Whether torch's JIT build takes an advisory lock on ``lock`` (torch >= 2.14) rather than a ``FileBaton``.

    Read from the names torch's ``_jit_compile`` itself calls, not from torch's version, so a backport or a
    patched build reads right. Only a ``FileBaton`` makes a file that outlives its holder a lock: where the
    JIT names none (torch >= 2.14 names ``FileLock``, or a layout this does not know), the file is asked.
    """
    jit_compile = getattr(cpp_extension, "_jit_compile", None)
    names = jit_compile.__code__.co_names if jit_compile is not None else tuple(vars(cpp_extension))
    return "FileBaton" not in names


def _advisory_lock_held(lock: str) -> bool:
    # torch takes it with filelock's FileLock: the same class, so the two exclude each other on every platform
    # and filesystem filelock supports. A non-blocking try; released at once if won.
    try:
        with FileLock(lock).acquire(timeout=0):
            return False
    except Timeout:
        return True


def _building_processes(directory: str) -> list[int]:
    """Processes working in ``directory``: torch runs the build (ninja, the compiler) there."""
    directory = os.path.realpath(directory)
    found = []
    for cwd in glob.glob("/proc/[0-9]*/cwd"):
        try:
            where = os.readlink(cwd)
        except OSError:  # gone, or another user's
            continue
        if where == directory or where.startswith(directory + os.sep):
            found.append(int(cwd.split("/")[2]))
    return found


def lock_state(directory: str, max_age_s: float = STALE_AFTER_S) -> LockState:
    """The build lock in ``directory``: free, held by a build, or (a ``FileBaton`` older than ``max_age_s`` with
    no build process in the directory) left by a killed build."""
    lock = os.path.join(directory, "lock")
    if not os.path.exists(lock):
        return LockState.FREE
    if lock_is_advisory():
        return LockState.HELD if _advisory_lock_held(lock) else LockState.FREE
    try:
        age = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:  # the build finished meanwhile
        return LockState.FREE
    if age >= max_age_s and not _building_processes(directory):
        return LockState.STALE
    return LockState.HELD


def check_op_build(builder_name: str = SHM_COMM_BUILDER, say: Callable[[str], None] = _say) -> None:
    """Before DeepSpeed loads the op of ``builder_name``: refuse a stale build lock, announce a build or a wait.

    Does nothing for an op DeepSpeed does not build on this accelerator or ships prebuilt. Messages go
    to ``say`` (stderr by default, so machine-readable stdout stays clean).

    Raises:
        StaleBuildLockError: the op's build lock was left by a killed build; the message names the file.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    if installed_ops.get(builder.NAME, False):
        return
    directory = build_directory(builder.NAME)
    state = lock_state(directory)
    if state is LockState.STALE:
        lock = os.path.join(directory, "lock")
        minutes = (time.time() - os.stat(lock).st_mtime) / 60
        raise StaleBuildLockError(
            f"{lock} is a build lock {minutes:.0f} minutes old and no build is running: a build of DeepSpeed's "
            f"{builder.absolute_name()} was killed half-way, and every process that loads the op would wait on "
            f"this file forever. Delete it (rm {lock}) and run again.")
    if state is LockState.HELD:
        say(f"waiting for another process building DeepSpeed's {builder.absolute_name()} in {directory} "
            f"({TYPICAL_BUILD})")
    elif not glob.glob(os.path.join(directory, "*.so")):
        say(f"building DeepSpeed's {builder.absolute_name()} in {directory} (first use of this extensions cache; "
            f"{TYPICAL_BUILD})")


__all__ = ["STALE_AFTER_S", "LockState", "StaleBuildLockError", "build_directory", "check_op_build",
           "lock_is_advisory", "lock_state"]
