import sys

import pytest


@pytest.fixture(autouse=True)
def _stock_deepspeed_initialize_after_each_test():
    """Importing safe_zero.accelerate binds its routing; leave the pytest process stock for other tests."""
    yield
    routing = sys.modules.get("safe_zero.accelerate.routing")
    if routing is not None:
        routing.uninstall_on_request()
