"""Drift safety: a DeepSpeed method a fix overrides that is renamed or re-signatured is refused at import."""

import inspect

import pytest


def _all_overriding():
    from safe_zero import wrappers

    return wrappers.OVERRIDING


def test_every_override_matches_this_deepspeed():
    from safe_zero import verify_overrides

    verify_overrides()  # also runs at `import safe_zero`; here explicitly, on this leg's DeepSpeed


def test_a_renamed_deepspeed_method_is_named_in_the_error(monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from safe_zero import DeepSpeedDriftError, verify_overrides

    # As if DeepSpeed renamed it: the mixin's override would never be called again.
    monkeypatch.setattr(DeepSpeedZeroOptimizer, "_round_robin_reorder_v2", DeepSpeedZeroOptimizer._round_robin_reorder,
                        raising=False)
    monkeypatch.delattr(DeepSpeedZeroOptimizer, "_round_robin_reorder")
    with pytest.raises(DeepSpeedDriftError, match=r"DeepSpeedZeroOptimizer\._round_robin_reorder is gone.*"
                                                  r"AlignRoundRobinGroups\._round_robin_reorder"):
        verify_overrides()


def test_a_re_signatured_deepspeed_method_is_named_in_the_error(monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from safe_zero import DeepSpeedDriftError, verify_overrides

    def process_gradients(self, param, group_index, extra):  # the override passes (param, i)
        raise AssertionError("never called")

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "process_gradients", process_gradients)
    with pytest.raises(DeepSpeedDriftError, match=r"process_gradients changed its signature.*"
                                                  r"ReduceInOneOrderStage12\.process_gradients passes \(param, i\)"):
        verify_overrides()


def test_a_decorated_deepspeed_method_is_checked_through_its_decorators(monkeypatch):
    """``instrument_w_nvtx`` hides ``fetch_sub_module``'s signature behind ``(*args, **kwargs)``, no ``__wrapped__``."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from safe_zero import DeepSpeedDriftError, verify_overrides

    def fetch_sub_module(self, module, forward):
        raise AssertionError("never called")

    def wrapped_fn(*args, **kwargs):
        return fetch_sub_module(*args, **kwargs)

    monkeypatch.setattr(PartitionedParameterCoordinator, "fetch_sub_module", wrapped_fn)
    with pytest.raises(DeepSpeedDriftError, match="fetch_sub_module changed its signature"):
        verify_overrides()


def test_every_mixin_method_that_shadows_deepspeed_is_marked():
    """An unmarked override would escape the drift check: every mixin method DeepSpeed's class also has is marked."""
    from safe_zero.patching import is_override, stock_class

    unmarked = []
    for safe in _all_overriding():
        stock = stock_class(safe)
        for mixin in safe.__mro__[: safe.__mro__.index(stock)]:
            for name, member in vars(mixin).items():
                if inspect.isfunction(member) and hasattr(stock, name) and not is_override(member):
                    if name.startswith("__") and name != "__init__":
                        continue
                    unmarked.append(f"{mixin.__qualname__}.{name}")
    assert not unmarked, f"mark these with @overrides: {sorted(set(unmarked))}"


def test_a_deepspeed_method_a_mixin_calls_is_checked_too(monkeypatch):
    """``AgreesOnModulesWhileRecording`` calls the coordinator's ``is_complete_trace`` (it overrides nothing of it)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from safe_zero import DeepSpeedDriftError, verify_overrides

    monkeypatch.delattr(PartitionedParameterCoordinator, "is_complete_trace")
    with pytest.raises(DeepSpeedDriftError, match=r"PartitionedParameterCoordinator\.is_complete_trace is gone.*"
                                                  r"AgreesOnModulesWhileRecording calls it"):
        verify_overrides()
