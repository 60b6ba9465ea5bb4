"""The routing `import safe_zero.accelerate` binds: a config with a "safe_zero" block goes through
safe_zero, a config without one stays exactly stock (and says so once on rank 0)."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from tests.support.bodies import HOOK_RUNS_WITHOUT_A_GRADIENT  # noqa: E402
from tests.support.models import Control, Gradless, build, ds_config, train  # noqa: E402


def _route(stage: int, world_size: int) -> dict:
    import deepspeed

    from safe_zero.accelerate import routing

    routing.install_on_request()
    try:
        asked = {**ds_config(stage, world_size=world_size), "safe_zero": {}}
        engine, *_ = deepspeed.initialize(model=build(Gradless), config=asked)
        safe_losses = train(engine, 2)
        safe = {"session": hasattr(engine, "safe_zero_session"), "optimizer": type(engine.optimizer).__name__,
                "losses": safe_losses, "registered": routing.session_of(engine.module) is engine.safe_zero_session}

        engine, *_ = deepspeed.initialize(model=build(Gradless), config=ds_config(stage, world_size=world_size))
        try:
            train(engine, 1)
            stock_error = None
        except AttributeError as e:
            stock_error = str(e)
        stock = {"session": hasattr(engine, "safe_zero_session"), "optimizer": type(engine.optimizer).__name__,
                 "error": stock_error, "warned": routing._warned_stock}
    finally:
        routing.uninstall_on_request()
    return {"safe": safe, "stock": stock, "restored": deepspeed.initialize is routing.STOCK_INITIALIZE}


@pytest.mark.parametrize("world_size", [1, 2])
def test_block_routes_through_safe_zero_and_no_block_stays_stock(ranks, world_size):
    for r in ranks.run(world_size, _route, stage=2, world_size=world_size):
        assert r["safe"]["session"] and r["safe"]["registered"]
        assert r["safe"]["optimizer"] == "SafeDeepSpeedZeroOptimizer"
        assert len(r["safe"]["losses"]) == 2
        assert not r["stock"]["session"] and r["stock"]["optimizer"] == "DeepSpeedZeroOptimizer"
        if HOOK_RUNS_WITHOUT_A_GRADIENT:
            assert "'NoneType' object has no attribute" in r["stock"]["error"], "stock ZeRO-2 stops on the grad-less"
        assert r["stock"]["warned"], "a stock run while safe_zero routing is bound is announced on rank 0"
        assert r["restored"]


def _accelerate_counts_one_process() -> tuple[int, str]:
    import deepspeed
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    from safe_zero.accelerate import WorldSizeMismatchError, routing

    routing.install_on_request()
    try:
        counted = PartialState().num_processes  # what a plain Accelerator() builds on a CPU host
        try:
            deepspeed.initialize(model=build(Gradless), config={**ds_config(2, world_size=2), "safe_zero": {}})
        except WorldSizeMismatchError as e:
            return counted, str(e)
        return counted, "no error"
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        routing.uninstall_on_request()


def test_a_cpu_world_size_mismatch_stops_before_deepspeed_and_says_what_to_pass(ranks):
    from accelerate import __version__

    for counted, message in ranks.run(2, _accelerate_counts_one_process):
        if counted == 2:  # this Accelerate counts the gloo group torch.distributed already has: nothing to stop
            assert message == "no error", (__version__, message)
            continue
        assert counted == 1, counted  # no backend on a CPU host, one process: the mismatch safe_zero stops
        assert message.startswith("Accelerate counts 1 process(es) but the DeepSpeed process group has 2"), message
        assert "safe_zero.accelerate.cpu_distributed_state()" in message and 'PartialState(backend="gloo")' in message


def _through_a_profiler() -> dict:
    import deepspeed

    from safe_zero.accelerate import routing

    stock = deepspeed.initialize
    calls = []

    def profiler(*args, **kwargs):  # bound before safe_zero's routing, as a profiler or tracer would be
        calls.append(kwargs["config"].get("safe_zero"))
        return stock(*args, **kwargs)

    deepspeed.initialize = profiler
    try:
        routing.install_on_request()
        engine, *_ = deepspeed.initialize(model=build(Gradless), config={**ds_config(2), "safe_zero": {}})
        safe = {"optimizer": type(engine.optimizer).__name__, "losses": train(engine, 2),
                "session": routing.session_of(engine.module) is engine.safe_zero_session}
        engine, *_ = deepspeed.initialize(model=build(Control), config=ds_config(2))
        stock_run = {"optimizer": type(engine.optimizer).__name__, "session": hasattr(engine, "safe_zero_session")}
        routing.uninstall_on_request()
        restored = deepspeed.initialize is profiler
    finally:
        deepspeed.initialize = stock
    return {"calls": calls, "safe": safe, "stock": stock_run, "restored": restored}


def test_a_wrapper_bound_before_the_routing_is_called_on_both_routes(ranks):
    (r,) = ranks.run(1, _through_a_profiler)
    assert r["calls"] == [{}, None], "the profiler sees the safe_zero call and the stock call, once each"
    assert r["safe"]["optimizer"] == "SafeDeepSpeedZeroOptimizer" and r["safe"]["session"]
    assert len(r["safe"]["losses"]) == 2, "the gradient-less parameter trains through the profiler"
    assert r["stock"] == {"optimizer": "DeepSpeedZeroOptimizer", "session": False}
    assert r["restored"], "uninstall_on_request puts the profiler back"
