"""grouped_mm expert weights in flat buffers: stock DeepSpeed puts them off the 16-byte grid, safe_zero does not.

Routes: ZeRO-1 and ZeRO-2 (``DeepSpeedZeroOptimizer``: DeepSpeed's ``parameter_alignment`` on >= 0.19.7,
safe_zero's layout before), ZeRO-1 + bf16 + fp32 gradient accumulation (``BF16_Optimizer``) and the fused
stage-0 ``FP16_Optimizer`` (safe_zero's layout on every release). CPU grouped_mm does not check alignment,
so the tests assert ``data_ptr() % 16 == 0`` directly.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from rig import RankFailure
from safe_zero._compat import DEEPSPEED_VERSION
from tests.support.grouped_mm import BF16_OPTIMIZER_REACHABLE
from tests.support.models import (OddExperts, TinyGptOss, batches, build, cpu_fused_adam, ds_config,
                                  skip_without_grouped_mm, skip_without_grouped_mm_transformers)

ROUTES = {
    "zero1": ("DeepSpeedZeroOptimizer", dict(stage=1)),
    "zero2": ("DeepSpeedZeroOptimizer", dict(stage=2)),
    "zero2_round_robin": ("DeepSpeedZeroOptimizer", dict(stage=2, zero={"round_robin_gradients": True})),
    "bf16_optimizer": ("BF16_Optimizer", dict(stage=1, data_types={"grad_accum_dtype": "fp32"})),
    "fused_stage0": ("FP16_Optimizer", dict(stage=0, client_optimizer=True)),
}
MODELS = {"odd": OddExperts, "gpt_oss": TinyGptOss}
# A flat-buffer route safe_zero lays out itself (no DeepSpeed padding) on every release.
OWN_ROUTE = "bf16_optimizer" if BF16_OPTIMIZER_REACHABLE else "fused_stage0"


def _skip_unreachable(route: str) -> None:
    if route == "bf16_optimizer" and not BF16_OPTIMIZER_REACHABLE:
        pytest.skip("this DeepSpeed routes ZeRO-1 + bf16 + fp32 accumulation to FP16_UnfusedOptimizer "
                    "(BFLOAT16 == DDP_BFLOAT16): no BF16_Optimizer, no flat buffer to align")


def _config(route: str, **safe_zero_block) -> dict:
    _, spec = ROUTES[route]
    spec = dict(spec)
    client = spec.pop("client_optimizer", False)
    stage = spec.pop("stage")
    config = ds_config(stage, **spec.pop("zero", {}))
    config.update(spec)
    if client:
        del config["optimizer"]
    if safe_zero_block:
        config["safe_zero"] = safe_zero_block
    return config


def _engine(model_name: str, route: str, safe: bool, **safe_zero_block):
    import deepspeed

    import safe_zero

    model = build(MODELS[model_name])
    config = _config(route, **safe_zero_block)
    optimizer = cpu_fused_adam()(model.parameters()) if "optimizer" not in config else None
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=None if optimizer else model.parameters(),
                      optimizer=optimizer, config=config)
    return engine


def _flat_buffers(optimizer) -> list[torch.Tensor]:
    for attr in ("bit16_groups_flat", "bf16_groups_flat", "fp16_groups_flat"):
        if hasattr(optimizer, attr):
            return getattr(optimizer, attr)
    raise AssertionError(f"{type(optimizer).__name__} has no flat buffers")


def _offsets(engine) -> dict[str, int]:
    import safe_zero

    return {name: p.data_ptr() % 16 for name, p in safe_zero.grouped_mm_parameters(engine.module).items()}


def _zero_copy(engine) -> bool:
    """Every grouped_mm weight is a view into one of the optimizer's flat buffers (no private copy)."""
    import safe_zero

    flats = {f.untyped_storage().data_ptr() for f in _flat_buffers(engine.optimizer)}
    return all(p.untyped_storage().data_ptr() in flats
               for p in safe_zero.grouped_mm_parameters(engine.module).values())


def _steps(engine, steps: int) -> tuple[list[float], list[dict[str, int]]]:
    """Train on one fixed batch (so the loss must fall); the weights' offsets after each step."""
    x = batches(1)[0]
    losses, offsets = [], []
    for _ in range(steps):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        offsets.append(_offsets(engine))
    return losses, offsets


def _state(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _route_body(model_name: str, route: str, ckpt: str) -> dict:
    """Stock layout, then safe_zero's, then safe_zero resumed from its own checkpoint, on one route."""
    stock = _engine(model_name, route, safe=False)
    out = {"stock_class": type(stock.optimizer).__name__, "stock_init": _offsets(stock)}
    del stock
    # The unpadded baseline trains under safe_zero with alignment off: stock layout, and it also runs where
    # stock DeepSpeed cannot step at all (0.18.x ZeRO-1/2 at world size 2 on gloo: see flat_buffer_autograd).
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unpadded = _engine(model_name, route, safe=True, alignment=False)
    out["unpadded_init"] = _offsets(unpadded)
    out["unpadded_losses"], out["unpadded_steps"] = _steps(unpadded, 3)
    del unpadded

    safe = _engine(model_name, route, safe=True)
    out["safe_class"] = type(safe.optimizer).__name__
    out["report"] = safe.safe_zero_session.report
    out["safe_init"] = _offsets(safe)
    out["zero_copy_init"] = _zero_copy(safe)
    out["safe_losses"], out["safe_steps"] = _steps(safe, 3)
    out["zero_copy_steps"] = _zero_copy(safe)
    safe.save_checkpoint(ckpt, tag="t")
    saved = _state(safe)
    out["continued"], _ = _steps(safe, 1)

    resumed = _engine(model_name, route, safe=True)
    resumed.load_checkpoint(ckpt, tag="t")
    out["loaded_equal"] = all(torch.equal(saved[n], p) for n, p in _state(resumed).items())
    out["resumed_init"] = _offsets(resumed)
    out["resumed"], out["resumed_steps"] = _steps(resumed, 1)

    if ROUTES[route][1]["stage"] > 0:
        from deepspeed.utils import safe_get_full_fp32_param

        # Each bf16 weight is linked to its own fp32 master fragment, also after the reordering.
        out["hp_linked"] = all(torch.equal(safe_get_full_fp32_param(p).to(p.dtype), p)
                               for p in resumed.module.parameters())
    if ROUTES[route][0] == "DeepSpeedZeroOptimizer":  # zero_to_fp32 reads no BF16_Optimizer checkpoint, stock or not
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
        out["fp32_keys_match"] = set(fp32) == set(saved)
        out["fp32_equal"] = all(torch.equal(fp32[n].to(saved[n].dtype), saved[n]) for n in saved)
    return out


# The hand-made layout on every route at both world sizes; GPT-OSS (slower) on every route at 1 and on ZeRO-2 at 2.
CASES = [("odd", route, ws) for route in ROUTES for ws in (1, 2) if route != "zero2_round_robin"] + \
        [("odd", "zero2_round_robin", 2)] + \
        [("gpt_oss", route, 1) for route in ROUTES if route != "zero2_round_robin"] + [("gpt_oss", "zero2", 2)]


@pytest.mark.parametrize("model_name, route, world_size", CASES)
def test_grouped_mm_weights_stay_aligned_zero_copy_and_resume(ranks, tmp_path, model_name, route, world_size):
    _skip_unreachable(route)
    if model_name == "gpt_oss":
        skip_without_grouped_mm_transformers()
    else:
        skip_without_grouped_mm()
    ckpt = str(tmp_path / "ckpt")
    # Four engines per body (stock, unpadded, safe, resumed): allow for a loaded machine.
    results = ranks.run(world_size, _route_body, model_name=model_name, route=route, ckpt=ckpt, timeout=600)
    stock_class = ROUTES[route][0]
    for r in results:
        # Red on stock: the route builds DeepSpeed's class and leaves a grouped_mm weight off the grid.
        assert r["stock_class"] == stock_class
        assert any(rem != 0 for rem in r["stock_init"].values()), r["stock_init"]
        assert r["unpadded_init"] == r["stock_init"] and r["unpadded_steps"][-1] == r["stock_init"]
        # Green with safe_zero: every detected weight on the grid after init and after each of 3 steps.
        assert r["safe_class"] == "Safe" + stock_class
        assert r["safe_init"] and set(r["safe_init"].values()) == {0}, r["safe_init"]
        assert all(set(o.values()) == {0} for o in r["safe_steps"]), r["safe_steps"]
        assert r["zero_copy_init"] and r["zero_copy_steps"], "weights must stay views into the flat buffer"
        assert "grouped_mm_alignment" in r["report"]
        # Same numbers as the stock layout, and training works.
        assert r["safe_losses"] == r["unpadded_losses"]
        assert all(torch.isfinite(torch.tensor(r["safe_losses"])))
        assert r["safe_losses"][-1] < r["safe_losses"][0]
        # The checkpoint written with the aligned layout loads back bit for bit, aligned, and resumes exactly.
        assert r["loaded_equal"]
        assert set(r["resumed_init"].values()) == {0}
        assert set(r["resumed_steps"][-1].values()) == {0}
        assert r["resumed"] == r["continued"]
        if "hp_linked" in r:
            assert r["hp_linked"], "safe_get_full_fp32_param must return each weight's own master copy"
        if "fp32_equal" in r:
            assert r["fp32_keys_match"] and r["fp32_equal"], "zero_to_fp32 must rebuild the model's state"
    assert results[0]["safe_losses"] == results[-1]["safe_losses"]


def _guard_body(route: str) -> str:
    # The fix off but alignment on: the guard must refuse the misaligned layout at initialize.
    _engine("odd", route, safe=True, fixes={"grouped_mm_alignment": False})
    return "built"


@pytest.mark.parametrize("route", ["bf16_optimizer", "fused_stage0"])
def test_guard_refuses_a_misaligned_weight_at_initialize_naming_it(ranks, route):
    _skip_unreachable(route)
    with pytest.raises(RankFailure, match=r"AlignmentError: .*not 16-byte aligned after initialize.*experts "
                                          r"\(data_ptr % 16 = 6\)"):
        ranks.run(1, _guard_body, route=route)


def _opt_out_body(route: str) -> dict:
    import warnings

    from safe_zero import AlignmentWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine("odd", route, safe=True, alignment=False)
    losses, offsets = _steps(engine, 1)
    return {"warned": [str(w.message) for w in caught if issubclass(w.category, AlignmentWarning)],
            "offsets": offsets[-1]}


def test_alignment_false_is_respected_with_a_warning(ranks):
    skip_without_grouped_mm()
    r, = ranks.run(1, _opt_out_body, route=OWN_ROUTE)
    assert r["offsets"] == {"experts": 6}
    assert len(r["warned"]) == 1 and "experts" in r["warned"][0] and "expected data_ptr" in r["warned"][0]


class _TwoOddExperts(torch.nn.Module):
    """Two marked weights whose sizes are not whole 16-byte units: no order puts both on the grid."""

    def __init__(self) -> None:
        super().__init__()
        import safe_zero

        self.a = safe_zero.mark_grouped_mm(torch.nn.Parameter(torch.randn(3, 1, 1)))
        self.b = safe_zero.mark_grouped_mm(torch.nn.Parameter(torch.randn(5, 1, 1)))

    def forward(self, x):
        return (x.sum() * (self.a.sum() + self.b.sum())).float()


MODELS["two_odd"] = _TwoOddExperts


def _impossible_body(route: str) -> str:
    _engine("two_odd", route, safe=True)
    return "built"


def test_impossible_layout_is_refused_at_initialize_with_a_working_configuration(ranks):
    with pytest.raises(RankFailure, match=r"AlignmentError: safe_zero cannot keep these grouped_mm weights 16-byte "
                                          r"aligned on the (BF16|FP16)_Optimizer route: a \(6 bytes\), b \(10 bytes\).*"
                                          r"parameter_alignment"):
        ranks.run(1, _impossible_body, route=OWN_ROUTE)


# --- ZeRO-3: a gathered weight is a fresh buffer (aligned) except where it is a view: the rank's own partition in
# the optimizer's flat buffer when a rank holds whole parameters (world size 1, with or without offload_param), and
# the shared all-reduce buffer of stage3_use_all_reduce_for_fetch_params. Other paths measured aligned (report).

ZERO3_PATHS = {
    "persistent": {},  # tiny parameters stay gathered (stage3_param_persistence_threshold default)
    "coalesced": {"stage3_param_persistence_threshold": 0},
    "offload": {"stage3_param_persistence_threshold": 0, "offload_param": {"device": "cpu"}},
    "all_reduce": {"stage3_param_persistence_threshold": 0, "stage3_use_all_reduce_for_fetch_params": True},
}
ZERO3_CASES = [(1, "persistent", True), (1, "offload", True), (2, "all_reduce", True), (2, "coalesced", False)]


def _zero3_engine(path: str, safe: bool):
    import deepspeed

    import safe_zero

    model = build(OddExperts)
    seen: list[int] = []
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(), config=ds_config(3, **ZERO3_PATHS[path]))
    # Registered after DeepSpeed's own pre-forward hook, so it sees the gathered weight grouped_mm will get.
    engine.module.register_forward_pre_hook(lambda module, args: seen.append(module.experts.data_ptr() % 16))
    return engine, seen


def _zero3_init_body(path: str) -> str:
    _zero3_engine(path, safe=True)
    return "built"


def _zero3_state(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return _state(engine)


def _zero3_body(path: str, ckpt: str) -> dict:
    stock, stock_seen = _zero3_engine(path, safe=False)
    out = {}
    out["stock_losses"], _ = _steps(stock, 3)
    out["stock_seen"] = stock_seen
    del stock

    safe, seen = _zero3_engine(path, safe=True)
    out["safe_losses"], _ = _steps(safe, 3)
    out["safe_seen"] = list(seen)
    out["report"] = safe.safe_zero_session.report
    safe.save_checkpoint(ckpt, tag="t")
    saved = _zero3_state(safe)
    out["continued"], _ = _steps(safe, 1)

    resumed, resumed_seen = _zero3_engine(path, safe=True)
    resumed.load_checkpoint(ckpt, tag="t")
    out["loaded_equal"] = all(torch.equal(saved[n], p) for n, p in _zero3_state(resumed).items())
    out["resumed"], _ = _steps(resumed, 1)
    out["resumed_seen"] = resumed_seen

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
    out["fp32_equal"] = set(fp32) == set(saved) and all(
        torch.equal(fp32[n].to(saved[n].dtype), saved[n]) for n in saved)
    return out


def _tight_all_reduce_fetch() -> bool:
    from safe_zero._compat import DEEPSPEED_VERSION, UNPADDED_ALL_REDUCE_FETCH

    return DEEPSPEED_VERSION in UNPADDED_ALL_REDUCE_FETCH


@pytest.mark.parametrize("world_size, path, stock_misaligned", ZERO3_CASES)
def test_zero3_gathered_grouped_mm_weights_are_aligned(ranks, tmp_path, world_size, path, stock_misaligned):
    if path == "all_reduce" and _tight_all_reduce_fetch():  # < 0.19.8: refused at initialize, see below
        with pytest.raises(RankFailure, match=r"AlignmentError: stage3_use_all_reduce_for_fetch_params on DeepSpeed "
                                              r"< 0\.19\.8 .*experts.*Turn stage3_use_all_reduce_for_fetch_params off"):
            ranks.run(world_size, _zero3_init_body, path=path)
        return
    skip_without_grouped_mm()
    results = ranks.run(world_size, _zero3_body, path=path, ckpt=str(tmp_path / "ckpt"), timeout=600)
    for r in results:
        assert len(r["stock_seen"]) == 3 and len(r["safe_seen"]) == 3
        if stock_misaligned:  # red on stock: the weight grouped_mm would get is off the grid
            assert set(r["stock_seen"]) != {0}, r["stock_seen"]
            assert "grouped_mm_alignment" in r["report"]
        else:
            assert set(r["stock_seen"]) == {0}
        assert set(r["safe_seen"]) == {0} and set(r["resumed_seen"]) == {0}, (r["safe_seen"], r["resumed_seen"])
        assert r["safe_losses"] == r["stock_losses"] and r["safe_losses"][-1] < r["safe_losses"][0]
        assert r["loaded_equal"] and r["resumed"] == r["continued"]
        assert r["fp32_equal"], "zero_to_fp32 must rebuild the model's state"


def _zero3_guard_body(path: str) -> str:
    import safe_zero

    model = build(OddExperts)
    config = ds_config(3, **ZERO3_PATHS[path])
    config["safe_zero"] = {"fixes": {"grouped_mm_alignment": False}}  # alignment wanted, the fix off
    engine, *_ = safe_zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    _steps(engine, 1)
    return "trained"


def test_zero3_guard_refuses_a_misaligned_weight_at_initialize_naming_it(ranks):
    with pytest.raises(RankFailure, match=r"AlignmentError: safe_zero cannot keep grouped_mm weight experts 16-byte "
                                          r"aligned on ZeRO-3 \(data_ptr % 16 = 6\): "
                                          r"the grouped_mm_alignment fix is off"):
        ranks.run(1, _zero3_guard_body, path="coalesced")


def test_zero3_guard_refuses_a_misaligned_gathered_weight_naming_it(ranks):
    if _tight_all_reduce_fetch():
        pytest.skip("DeepSpeed < 0.19.8 refuses the all-reduce fetch at initialize (tested above)")
    with pytest.raises(RankFailure, match=r"AlignmentError: safe_zero alignment guard: grouped_mm weight experts was "
                                          r"gathered 8 bytes off the 16-byte grid by ZeRO-3"):
        ranks.run(2, _zero3_guard_body, path="all_reduce")


def _zero3_two_groups_body() -> str:
    import safe_zero

    model = build(OddExperts)
    rest = [p for n, p in model.named_parameters() if n != "odd"]
    optimizer = torch.optim.Adam([{"params": [model.odd]}, {"params": rest}], lr=1e-2)
    config = ds_config(3)
    del config["optimizer"]
    safe_zero.initialize(model=model, optimizer=optimizer, config=config)
    return "built"


def test_zero3_refuses_at_initialize_a_weight_that_an_earlier_param_group_pushes_off_the_grid(ranks):
    # Reordering stays inside a parameter group; the 6-byte group before the expert weight cannot be undone.
    with pytest.raises(RankFailure, match=r"AlignmentError: safe_zero cannot keep grouped_mm weight experts 16-byte "
                                          r"aligned on ZeRO-3 \(data_ptr % 16 = 6\): "
                                          r"the optimizer parameter groups before it"):
        ranks.run(1, _zero3_two_groups_body)


def _stock_checkpoint_body(route: str, ckpt: str) -> dict:
    stock = _engine("odd", route, safe=False)
    _steps(stock, 1)
    stock.save_checkpoint(ckpt, tag="stock")
    stock_next, _ = _steps(stock, 2)
    # What stock's own resume does (DeepSpeed 0.18.3's fused stage 0 skips the first step after a load).
    resumed = _engine("odd", route, safe=False)
    resumed.load_checkpoint(ckpt, tag="stock")
    resumed_next, _ = _steps(resumed, 2)
    safe = _engine("odd", route, safe=True)
    safe.load_checkpoint(ckpt, tag="stock")
    order = safe.optimizer._flat_order()
    safe_next, offsets = _steps(safe, 2)
    weights = all(torch.equal(a, b) for a, b in zip(safe.module.state_dict().values(),
                                                    resumed.module.state_dict().values()))
    return {"reordered": order, "stock_next": stock_next, "stock_resumed_next": resumed_next,
            "safe_next": safe_next, "offsets": offsets[-1], "module_equal": weights}


@pytest.mark.parametrize("route", ["bf16_optimizer", "fused_stage0"])
def test_a_stock_checkpoint_is_laid_out_again_not_loaded_onto_the_wrong_parameters(ranks, tmp_path, route):
    # Same buffer size, other order: DeepSpeed alone would copy the master weights and Adam state across silently.
    _skip_unreachable(route)
    skip_without_grouped_mm()
    r, = ranks.run(1, _stock_checkpoint_body, route=route, ckpt=str(tmp_path / "ckpt"))
    assert r["reordered"], "the safe_zero run must lay the buffer out in its own order for this test to mean anything"
    # Two steps after the load, as stock's own resume takes them: the second one reads the restored optimizer state.
    assert r["safe_next"] == r["stock_resumed_next"] and r["module_equal"], r
    if DEEPSPEED_VERSION >= Version("0.18.9"):  # ... which there continues the uninterrupted run exactly
        assert r["stock_resumed_next"] == r["stock_next"], r
    assert r["offsets"] == {"experts": 0}
