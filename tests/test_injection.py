"""The injection is scoped, reversible and loud: safe classes only inside safe_zero.initialize, stock elsewhere."""

import importlib
import json
import re
import types

import pytest

from rig import RankFailure
from tests.support.bodies import HOOK_RUNS_WITHOUT_A_GRADIENT
from tests.support.models import Control, OddExperts, ZeroSized, build, ds_config, train


def _bindings_now():
    from safe_zero.injection import BINDINGS

    return [getattr(importlib.import_module(b.module), b.name) for b in BINDINGS]


def _safe_then_stock_zero3() -> dict:
    """safe_zero.initialize, then a plain deepspeed.initialize of the same failing model in the same process."""
    import deepspeed

    import safe_zero
    from safe_zero import wrappers
    from safe_zero.injection import BINDINGS

    model = build(Control)
    engine, optimizer, *_ = safe_zero.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    safe_losses = train(engine, 2)
    restored = all(now is b.stock for now, b in zip(_bindings_now(), BINDINGS))
    coordinator = engine.optimizer.parameter_offload.param_coordinator

    model = build(ZeroSized)
    stock_engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    stock_is_stock = not isinstance(stock_engine.optimizer, wrappers.SAFE_CLASSES)
    try:
        train(stock_engine, 1)
        stock_error = None
    except AssertionError as e:
        stock_error = str(e)
    return {
        "safe_optimizer": type(optimizer).__name__,
        "safe_coordinator": type(coordinator).__name__,
        "restored": restored,
        "stock_is_stock": stock_is_stock,
        "stock_error": stock_error,
        "safe_losses": safe_losses,
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_bindings_are_restored_and_a_later_plain_initialize_is_stock(ranks, world_size):
    for r in ranks.run(world_size, _safe_then_stock_zero3):
        assert r["safe_optimizer"] == "SafeDeepSpeedZeroOptimizer_Stage3"
        assert r["safe_coordinator"] == "SafePartitionedParameterCoordinator"
        assert r["restored"]
        assert r["stock_is_stock"]
        assert r["stock_error"] is not None and "NOT_AVAILABLE" in r["stock_error"]


def _install_routes_plain_initialize(stage: int) -> dict:
    import deepspeed

    import safe_zero
    from safe_zero.injection import STOCK_INITIALIZE

    assert deepspeed.initialize is STOCK_INITIALIZE
    safe_zero.install()
    safe_zero.install()  # idempotent: the second call must not wrap the first
    installed = deepspeed.initialize
    try:
        model = build(Control)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage))
        train(engine, 1)
        routed = hasattr(engine, "safe_zero_session")
    finally:
        safe_zero.uninstall()
        safe_zero.uninstall()
    return {"routed": routed, "restored": deepspeed.initialize is STOCK_INITIALIZE,
            "single_wrap": installed is safe_zero.injection._installed_initialize,
            "optimizer": type(engine.optimizer).__name__}


def test_install_routes_every_initialize_and_uninstall_restores_stock_exactly(ranks):
    (r,) = ranks.run(1, _install_routes_plain_initialize, stage=2)
    assert r == {"routed": True, "restored": True, "single_wrap": True, "optimizer": "SafeDeepSpeedZeroOptimizer"}


def _bindings_restored_after_failed_initialize() -> bool:
    import safe_zero
    from safe_zero.injection import BINDINGS

    model = build(Control)
    bad = ds_config(2)
    bad["train_batch_size"] = 3  # inconsistent with micro batch 2 x 1 rank: DeepSpeed raises inside initialize
    with pytest.raises(AssertionError):
        safe_zero.initialize(model=model, model_parameters=model.parameters(), config=bad)
    return all(now is b.stock for now, b in zip(_bindings_now(), BINDINGS))


def test_bindings_are_restored_when_initialize_raises(ranks):
    assert ranks.run(1, _bindings_restored_after_failed_initialize) == [True]


def _initialize_from_json_path(path: str, via_args: bool) -> dict:
    import safe_zero

    model = build(Control)
    if via_args:
        args = types.SimpleNamespace(deepspeed_config=path, local_rank=0)
        engine, *_ = safe_zero.initialize(args=args, model=model, model_parameters=model.parameters())
    else:
        engine, *_ = safe_zero.initialize(model=model, model_parameters=model.parameters(), config=path)
    return {"fixes": dict(engine.safe_zero_session.options.fixes), "optimizer": type(engine.optimizer).__name__}


@pytest.mark.parametrize("via_args", [False, True], ids=["config-path", "args.deepspeed_config"])
def test_the_safe_zero_block_is_read_from_a_config_file(ranks, tmp_path, via_args):
    config = ds_config(2)
    config["safe_zero"] = {"fixes": {"gradless_params": False}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    (r,) = ranks.run(1, _initialize_from_json_path, path=str(path), via_args=via_args)
    assert r == {"fixes": {"gradless_params": False}, "optimizer": "SafeDeepSpeedZeroOptimizer"}


def _fixes_can_be_switched_off(stage: int) -> str:
    import safe_zero

    from tests.support.models import Gradless

    model = build(Gradless)
    config = ds_config(stage)
    config["safe_zero"] = {"fixes": {"gradless_params": False}}
    engine, *_ = safe_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    train(engine, 1)
    return "trained"


@pytest.mark.skipif(not HOOK_RUNS_WITHOUT_A_GRADIENT, reason="this torch runs no hook for a None gradient: stock "
                    "does not stop on the grad-less parameter, so nothing tells the fix off from on")
@pytest.mark.parametrize("stage", [2, 3])
def test_a_fix_switched_off_in_the_config_is_really_off(ranks, stage):
    # ZeRO-3's hooks first run long after initialize returned: they must still see the caller's options.
    with pytest.raises(RankFailure, match="'NoneType' object has no attribute"):
        ranks.run(1, _fixes_can_be_switched_off, stage=stage)


UNREACHABLE_MODES = [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
     "SuperOffload"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}, "ZenFlow"),
    ({"zero_optimization": {"stage": 3}, "compile": {"deepcompile": True}}, "DeepCompile"),
]


@pytest.mark.parametrize("config, mode", UNREACHABLE_MODES)
def test_a_mode_the_injection_cannot_reach_runs_stock_when_the_model_needs_no_fix(monkeypatch, caplog, config, mode):
    # Never worse than stock: nothing in the model for safe_zero to fix, so the mode runs exactly as stock runs it
    # (ZenFlow and SuperOffload need CPU Adam / GPU ops to build; the decision is what is tested here).
    import safe_zero
    from safe_zero import injection

    calls = []

    def stock_initialize(*args, **kwargs):
        calls.append({"bindings_stock": all(now is b.stock for now, b in zip(_bindings_now(), injection.BINDINGS)),
                      "config": kwargs.get("config")})
        return (types.SimpleNamespace(), None, None, None)

    monkeypatch.setattr(injection, "STOCK_INITIALIZE", stock_initialize)
    with caplog.at_level("WARNING"):
        engine, *_ = safe_zero.initialize(model=Control(), config=config)
    assert calls == [{"bindings_stock": True, "config": config}]
    assert engine.safe_zero_session.report == {}
    assert any(f"no fix applies to this model under {mode}" in r.getMessage() for r in caplog.records)


def _needs_the_injection(mode: str, model_cls: type) -> bool:
    """Whether the model needs a fix only the injection applies, under this mode, on this DeepSpeed."""
    from safe_zero._compat import DEEPSPEED_PADS_PARAMETERS, DEEPSPEED_VERSION

    if mode != "ZenFlow":  # ZeRO-3 modes: the ZeRO-3 zero-element fix and ZeRO-3 alignment are needed everywhere
        return True
    if model_cls is ZeroSized:  # ZeRO-2: DeepSpeed 0.19.8 keeps zero-element parameters out of the flat groups
        return DEEPSPEED_VERSION.release < (0, 19, 8)
    return not DEEPSPEED_PADS_PARAMETERS  # ZenFlow's optimizer takes DeepSpeed's parameter_alignment


@pytest.mark.parametrize("config, mode", UNREACHABLE_MODES)
@pytest.mark.parametrize("model_cls, need", [(ZeroSized, "zero-element parameter"), (OddExperts, "grouped_mm")])
def test_a_mode_the_injection_cannot_reach_is_refused_where_the_model_needs_a_fix(monkeypatch, config, mode,
                                                                                    model_cls, need):
    import safe_zero
    from safe_zero import injection

    calls = []
    monkeypatch.setattr(injection, "STOCK_INITIALIZE",
                        lambda *args, **kwargs: calls.append(kwargs["config"]) or (types.SimpleNamespace(),))
    if _needs_the_injection(mode, model_cls):
        with pytest.raises(safe_zero.UnreachableModeError, match=f"{mode}.*this model needs .*{need}"):
            safe_zero.initialize(model=build(model_cls), config=config)
        assert calls == []
    else:  # stock DeepSpeed trains it in this mode: run stock, with DeepSpeed's own padding where alignment needs it
        safe_zero.initialize(model=build(model_cls), config=config)
        assert len(calls) == 1
        assert calls[0]["zero_optimization"].get("parameter_alignment") is (True if model_cls is OddExperts else None)


def test_deepcompile_is_refused_for_an_moe_whose_blocks_zero3_must_gather_whole():
    import safe_zero
    from deepspeed.utils import z3_leaf_module

    from tests.support.models import ExpertMoE

    model = build(ExpertMoE)
    config = {"zero_optimization": {"stage": 3}, "compile": {"deepcompile": True}}
    with pytest.raises(safe_zero.UnreachableModeError, match="DeepCompile.*MoE block.*moe.*gathered whole"):
        safe_zero.initialize(model=model, config=config)
    assert not z3_leaf_module(model.moe), "a refused initialize leaves the model as it was"


def test_fp16_on_a_cpu_without_fp16_gets_an_actionable_error(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    import safe_zero
    from safe_zero.injection import check_precision

    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda: False)
    with pytest.raises(safe_zero.UnsupportedPrecisionError, match='"bf16": {"enabled": true}'):
        safe_zero.initialize(model=Control(), config=ds_config(2, dtype="fp16"))
    # Where DeepSpeed's CPU accelerator runs fp16 (oneDNN fp16 kernels), so does safe_zero: never worse than stock.
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda: True)
    check_precision(ds_config(2, dtype="fp16"))


def test_a_drifted_deepspeed_binding_is_named_in_the_error():
    import safe_zero
    from safe_zero.injection import Binding, verify_bindings
    from safe_zero.wrappers import SafeDeepSpeedZeroOptimizer

    drifted = (Binding("deepspeed.runtime.engine", "NoSuchOptimizerAnyMore", SafeDeepSpeedZeroOptimizer),)
    with pytest.raises(safe_zero.DeepSpeedDriftError, match="deepspeed.runtime.engine.NoSuchOptimizerAnyMore"):
        verify_bindings(drifted)


def test_an_unsupported_deepspeed_version_is_refused_with_the_supported_range():
    from packaging.version import Version

    import safe_zero
    from safe_zero._compat import SUPPORTED_DEEPSPEED, check_deepspeed_supported

    for version in ("0.17.6", "0.20.0"):
        with pytest.raises(safe_zero.UnsupportedDeepSpeedError, match=re.escape(str(SUPPORTED_DEEPSPEED))):
            check_deepspeed_supported(Version(version))
    check_deepspeed_supported(Version("0.19.8"))


def test_a_stock_wrapper_behind_safe_zeros_back_is_an_error():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    import safe_zero
    from safe_zero.injection import verify_engine

    engine = types.SimpleNamespace(optimizer=DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer))
    with pytest.raises(safe_zero.InjectionError, match="stock DeepSpeedZeroOptimizer"):
        verify_engine(engine)
