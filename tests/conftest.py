import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402

from tests.rig import Pools  # noqa: E402


@pytest.fixture(scope="session")
def ranks():
    """``ranks.run(world_size, body, **kwargs)`` runs a module-level body on CPU/gloo ranks."""
    pools = Pools()
    yield pools
    pools.close()
