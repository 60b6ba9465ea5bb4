import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-builds its CPU comm op under one name for every release; a cache shared by two
# virtual environments with different DeepSpeed releases loads the wrong build. One per venv.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

import pytest  # noqa: E402

from rig import Pools  # noqa: E402
from safe_zero.probes import deepspeed_shm_segments, release_shm  # noqa: E402

_SHM_BEFORE: set[str] = set()


@pytest.fixture(scope="session")
def ranks():
    """``ranks.run(world_size, body, **kwargs)`` runs a module-level body on CPU/gloo ranks."""
    pools = Pools()
    yield pools
    pools.close()


def pytest_sessionstart(session):
    _SHM_BEFORE.update(deepspeed_shm_segments())
    # Build DeepSpeed's CPU comm op once, here, before any test spawns ranks: two ranks racing to
    # JIT-build it in a cold venv can outlast the pool's start timeout and leave a stale build lock.
    from deepspeed.comm.torch import build_shm_op

    from safe_zero.op_builds import StaleBuildLockError, check_op_build

    try:
        check_op_build()
    except StaleBuildLockError as e:
        pytest.exit(str(e), returncode=pytest.ExitCode.USAGE_ERROR)
    build_shm_op()


def pytest_sessionfinish(session, exitstatus):
    # Scripts the tests launch (Lightning, accelerate launch, examples) leave DeepSpeed's shm workspaces too.
    release_shm(deepspeed_shm_segments() - _SHM_BEFORE)
