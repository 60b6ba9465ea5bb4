"""DeepSpeed's JIT-built ops: say when a build starts, and find a build lock that nothing will release.

On first use DeepSpeed compiles its CPU ops (the shared-memory comm op that every CPU process group
loads) into the torch extensions cache, under a lock file in the op's build directory. Every later
process, also one that only loads the finished build, waits while that file exists. A build killed
half-way leaves it behind, and from then on every process waits forever, without a word.
:func:`check_op_build` runs before the op is loaded: it says when a build is about to start and how
long it takes, and raises :class:`StaleBuildLockError`, naming the file to delete, for a lock that no
build holds.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from typing import Callable

from safe_zero.errors import StaleBuildLockError  # noqa: F401  (re-exported)

#: A build lock older than this, with no build process in its directory, was left by a killed build.
STALE_AFTER_S = 300.0
#: What a first build of the CPU comm op costs (measured: ~60 s on 2 shared cores).
TYPICAL_BUILD = "about a minute on 2 CPU cores"
#: The op every CPU process group loads (``deepspeed.comm.torch.build_shm_op``).
SHM_COMM_BUILDER = "ShareMemCommBuilder"


def _say(message: str) -> None:
    print(f"safe_zero: {message}", file=sys.stderr, flush=True)


def build_directory(op_name: str) -> str:
    """Where torch builds (and DeepSpeed loads) the JIT op ``op_name``: ``$TORCH_EXTENSIONS_DIR/<op_name>``."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(op_name, verbose=False)


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


def stale_lock(directory: str, max_age_s: float = STALE_AFTER_S) -> str | None:
    """The lock file in ``directory`` if a killed build left it there (older than ``max_age_s``, no build running)."""
    lock = os.path.join(directory, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return None
    if age < max_age_s or _building_processes(directory):
        return None
    return lock


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
    lock = stale_lock(directory)
    if lock is not None:
        minutes = (time.time() - os.stat(lock).st_mtime) / 60
        raise StaleBuildLockError(
            f"{lock} is a build lock {minutes:.0f} minutes old and no build is running: a build of DeepSpeed's "
            f"{builder.absolute_name()} was killed half-way, and every process that loads the op would wait on "
            f"this file forever. Delete it (rm {lock}) and run again.")
    if os.path.exists(os.path.join(directory, "lock")):
        say(f"waiting for another process building DeepSpeed's {builder.absolute_name()} in {directory} "
            f"({TYPICAL_BUILD})")
    elif not glob.glob(os.path.join(directory, "*.so")):
        say(f"building DeepSpeed's {builder.absolute_name()} in {directory} (first use of this extensions cache; "
            f"{TYPICAL_BUILD})")


__all__ = ["STALE_AFTER_S", "StaleBuildLockError", "build_directory", "check_op_build", "stale_lock"]
