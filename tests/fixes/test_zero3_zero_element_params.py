"""Zero-element parameters under ZeRO-3: stock DeepSpeed fails on every path, safe_zero trains them all.

Each world size runs three batched rank bodies over all scenarios, cached per module: stock,
safe_zero, and stock on each scenario's model without its zero-element parameters (the numbers'
reference: safe_zero must train the model with them to the same bits); the tests below read their
scenario's result. A scenario's exception comes back as text, so the stock tests assert DeepSpeed's
own error. Stock failures are symmetric across ranks (the same assertion / the same ``torch.cat``),
so catching them in the body never strands a rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn

from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import coalesced_gather_wait
from tests.support.models import Control, FrozenEmpty, ZeroSized, batches, build, ds_config

EMPTY_SHAPE = (0, 8)

#: Set while a rank body builds the models without their zero-element parameters (``_run_scenarios(bare=True)``):
#: each model class below then leaves them, and the terms they add, out. A zero-element parameter adds an exact
#: zero to the loss and to its input's gradient, so that model must train to the very same bits.
_BARE = False

# ---------------------------------------------------------------------------------------------- models


class Mixed(nn.Module):
    """A sized and a zero-element parameter in one submodule: one coalesced gather bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.block = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.relu(self.dense(x)))


class _Block(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.empty = None if _BARE else nn.Parameter(torch.zeros(EMPTY_SHAPE))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = (h @ self.weight.t()).pow(2).mean()
        return out if self.empty is None else out + (h @ self.empty.t()).sum()


class Full(nn.Module):
    """Both shapes: a mixed bucket and a submodule whose only parameter is zero-element."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.block = _Block()
        self.head = None if _BARE else nn.Linear(8, 0, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dense(x))
        return self.block(h) if self.head is None else self.block(h) + self.head(h).sum()


class Chain(nn.Module):
    """``k`` all-zero-element submodules in a row between sized ones (k=0: the same model without them)."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        k = 0 if _BARE else k
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)
        # Built last, so the sized layers draw the same random init whatever k is.
        self.empties = nn.ModuleList(nn.Linear(8, 0, bias=False) for _ in range(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        extra = sum(e(h).sum() for e in self.empties)
        h = torch.relu(self.second(h))
        return self.out(h).pow(2).mean() + extra


class Quantizable(nn.Module):
    """Sized partitions DeepSpeed's quantizer accepts (a multiple of 8 elements per rank) and a frozen empty layer."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 16, bias=False)
        self.empty = None if _BARE else FrozenEmpty()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dense(x).pow(2).mean()
        return out if self.empty is None else out + self.empty(x).sum()


class _DenseOnly(nn.Module):
    """``ZeroSized`` without its zero-output-feature layer (the same first draws: the dense layer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x).pow(2).mean()


def _zero_sized() -> nn.Module:
    return build(_DenseOnly if _BARE else ZeroSized)


def _frozen_empty() -> nn.Module:
    model = _zero_sized()
    if not _BARE:
        model.empty.weight.requires_grad_(False)
    return model


# ------------------------------------------------------------------------------------ stand-in quantizer


class TorchQuantizerKernels:
    """Pure-torch stand-in for DeepSpeed's compiled ``QuantizerBuilder`` module (CPU has no CUDA kernels).

    Same entry points as ``csrc/quantization/pt_binding.cpp`` for 8-bit symmetric quantization:
    ``quantize(x, groups, bits, type) -> [int8 of x's shape, float32 scales]`` and
    ``dequantize(q, scales, groups, bits, type) -> fp16``. DeepSpeed's own ``CUDAQuantizer``
    (its group search included) runs unchanged on top of it. One difference: the kernel's scales
    are ``(groups, 1)``; these are flat ``(groups,)``, because DeepSpeed gathers them into a flat
    buffer, which NCCL accepts by size but gloo's ``all_gather_into_tensor`` rejects by shape.
    """

    Symmetric = "symmetric"

    def quantize(self, x: torch.Tensor, groups: int, bits: int, qtype: Any) -> list[torch.Tensor]:
        grouped = x.float().reshape(groups, -1)
        scale = grouped.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        q = (grouped / scale).round().clamp(-127, 127).to(torch.int8).reshape(x.shape)
        return [q, scale.reshape(groups)]

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, groups: int, bits: int, qtype: Any) -> torch.Tensor:
        return (q.float().reshape(groups, -1) * scale.reshape(groups, 1)).to(torch.half).reshape(q.shape)


@contextlib.contextmanager
def stand_in_quantizer() -> Iterator[None]:
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    saved = CUDAQuantizer.quantizer_cuda_module
    CUDAQuantizer.quantizer_cuda_module = TorchQuantizerKernels()
    try:
        yield
    finally:
        CUDAQuantizer.quantizer_cuda_module = saved


# ------------------------------------------------------------------------------------------- helpers


def _engine(model: nn.Module, safe: bool, world_size: int, *, dtype: str = "bf16", optimizer: bool = True,
            extra: dict | None = None, **zero: Any) -> Any:
    import deepspeed

    import safe_zero

    config = ds_config(3, dtype=dtype, world_size=world_size, **zero)
    config.update(extra or {})
    init = safe_zero.initialize if safe else deepspeed.initialize
    if _BARE and world_size > 1 and coalesced_gather_wait.FIX.needed(DEEPSPEED_VERSION):
        # The reference must be right: stock's gather of persistent parameters after a step may return before it
        # landed here (an inf loss once in CI on 0.18.9), so the reference is stock with only that wait completed.
        config["safe_zero"] = {"fixes": {name: name == coalesced_gather_wait.FIX.name for name in safe_zero.FIXES}}
        init = safe_zero.initialize
    if not optimizer:
        config.pop("optimizer")
        return init(model=model, config=config)[0]
    return init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=config)[0]


def _dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "bf16" else torch.float32


def _fit(engine: Any, steps: int, dtype: str = "bf16") -> list[float]:
    """Train on one fixed batch, so a working optimizer makes the loss fall."""
    x = batches(1, dtype=_dtype(dtype))[0]
    losses = []
    for _ in range(steps):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def _gathered(module: nn.Module) -> dict[str, Any]:
    """Every parameter's shape and dtype with all of them gathered (real shapes, not partitions)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {name: (tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters()}


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    """The sized parameters' values, gathered."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {name: p.detach().float().clone() for name, p in module.named_parameters() if p.numel()}


def _trained(engine: Any, steps: int = 3, dtype: str = "bf16") -> dict[str, Any]:
    losses = _fit(engine, steps, dtype)
    return {"losses": losses, "params": _gathered(engine.module), "values": _values(engine.module),
            "report": _report(engine)}


def _report(engine: Any) -> list[str]:
    session = getattr(engine, "safe_zero_session", None)
    return list(session.report.get("zero3_zero_element_params", [])) if session else []


# ------------------------------------------------------------------------------------------ scenarios


def s_only_trainable(safe: bool, ws: int) -> dict:
    return _trained(_engine(_zero_sized(), safe, ws, stage3_param_persistence_threshold=0))


def s_only_frozen(safe: bool, ws: int) -> dict:
    return _trained(_engine(_frozen_empty(), safe, ws, stage3_param_persistence_threshold=0))


def s_only_fp32(safe: bool, ws: int) -> dict:
    return _trained(_engine(_zero_sized(), safe, ws, dtype="fp32", stage3_param_persistence_threshold=0),
                    dtype="fp32")


def s_mixed_bucket(safe: bool, ws: int) -> dict:
    return _trained(_engine(build(Mixed), safe, ws, stage3_param_persistence_threshold=0))


def s_prefetch_chain(safe: bool, ws: int) -> dict:
    return _trained(_engine(build(Chain), safe, ws, stage3_param_persistence_threshold=0,
                            stage3_prefetch_bucket_size=16), steps=3)


def s_offload(safe: bool, ws: int) -> dict:
    return _trained(_engine(build(Full), safe, ws, stage3_param_persistence_threshold=0,
                            offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"},
                            extra={"zero_force_ds_cpu_optimizer": False}))


def s_persist_large(safe: bool, ws: int) -> dict:
    return _trained(_engine(build(Full), safe, ws, stage3_param_persistence_threshold=10**6))


def s_quant_nontrainable(safe: bool, ws: int) -> dict:
    with stand_in_quantizer():
        return _trained(_engine(build(Quantizable), safe, ws, stage3_param_persistence_threshold=0,
                                zero_quantized_nontrainable_weights=True))


def s_quant_weights(safe: bool, ws: int) -> dict:
    with stand_in_quantizer():
        return _trained(_engine(build(Quantizable), safe, ws, stage3_param_persistence_threshold=0,
                                zero_quantized_weights=True))


def s_eval_no_grad(safe: bool, ws: int) -> dict:
    engine = _engine(build(Full), safe, ws, stage3_param_persistence_threshold=0)
    engine.eval()
    x = batches(1)[0]
    with torch.no_grad():
        evals = [engine(x).float().item() for _ in range(2)]
    engine.train()
    result = _trained(engine, steps=2)
    return {**result, "evals": evals}


def s_inference_only(safe: bool, ws: int) -> dict:
    engine = _engine(build(Full), safe, ws, optimizer=False, stage3_param_persistence_threshold=0)
    x = batches(1)[0]
    with torch.no_grad():
        outs = [engine(x).float().item() for _ in range(3)]
    return {"evals": outs, "params": _gathered(engine.module), "values": _values(engine.module)}


def s_zero_init(safe: bool, ws: int) -> dict:
    """The model is built partitioned: under ``safe_zero.Init`` (stock: ``deepspeed.zero.Init``)."""
    import deepspeed

    import safe_zero

    config = ds_config(3, world_size=ws, stage3_param_persistence_threshold=0)
    torch.manual_seed(0)
    with (safe_zero.Init if safe else deepspeed.zero.Init)(config_dict_or_path=config):
        model = Full()
    return _trained(_engine(model, safe, ws, stage3_param_persistence_threshold=0))


def s_zero_init_quant(safe: bool, ws: int) -> dict:
    """zero.Init partitions (and quantizes) a frozen empty layer while the model is built."""
    import deepspeed

    import safe_zero

    zero = dict(stage3_param_persistence_threshold=0, zero_quantized_nontrainable_weights=True)
    with stand_in_quantizer():
        torch.manual_seed(0)
        with (safe_zero.Init if safe else deepspeed.zero.Init)(config_dict_or_path=ds_config(3, world_size=ws, **zero)):
            model = Quantizable()
        return _trained(_engine(model, safe, ws, **zero))


def s_zero_init_installed(safe: bool, ws: int) -> dict:
    """After ``safe_zero.install()`` plain ``deepspeed.zero.Init`` and ``deepspeed.initialize`` are safe_zero's."""
    import deepspeed

    import safe_zero

    stock_init, stock_initialize = deepspeed.zero.Init, deepspeed.initialize
    config = ds_config(3, world_size=ws, stage3_param_persistence_threshold=0)
    if safe:
        safe_zero.install()
    try:
        routed = deepspeed.zero.Init is safe_zero.Init
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Full()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        result = _trained(engine)
    finally:
        safe_zero.uninstall()
    restored = deepspeed.zero.Init is stock_init and deepspeed.initialize is stock_initialize
    return {**result, "routed": routed, "restored": restored}


def s_control(safe: bool, ws: int) -> dict:
    return _trained(_engine(build(Control), safe, ws, stage3_param_persistence_threshold=0))


def _count_collectives(engine: Any, steps: int) -> tuple[list[dict[str, int]], list[float]]:
    """Per step, how many collectives of each kind DeepSpeed's comm backend issued."""
    from deepspeed.comm import comm

    names = ["all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced", "all_reduce",
             "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
             "all_to_all_single", "all_to_all"]
    backend = comm.cdb
    counts: dict[str, int] = {}

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            if name == "all_gather_into_tensor":
                output = kwargs.get("output_tensor", args[0] if args else None)
                counts["gathered_elements"] = counts.get("gathered_elements", 0) + output.numel()
            return fn(*args, **kwargs)
        return wrapper

    for name in names:
        setattr(backend, name, counting(name, getattr(backend, name)))
    try:
        per_step, losses = [], []
        x = batches(1)[0]
        for _ in range(steps):
            counts.clear()
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            per_step.append(dict(counts))
            losses.append(loss.float().item())
    finally:
        for name in names:
            delattr(backend, name)
    return per_step, losses


def s_count(safe: bool, ws: int) -> dict:
    """The same model with and without 3 all-zero-element submodules: the collectives per step.

    With DeepSpeed's default prefetch bucket and with a tiny one (16 elements), which makes the
    prefetcher walk past the empty parameters in its trace.
    """
    out = {}
    for bucket in (None, 16):
        zero = {"stage3_prefetch_bucket_size": bucket} if bucket else {}
        for k in (0, 3):
            torch.manual_seed(0)
            engine = _engine(Chain(k), safe, ws, stage3_param_persistence_threshold=0, **zero)
            out[f"k{k}_bucket{bucket}"] = _count_collectives(engine, 3)
    return out


def s_checkpoint(safe: bool, ws: int, ckpt_dir: str = "") -> dict:
    """save → load into a differently initialized engine → continue, plus every consolidation path."""
    import deepspeed

    from safe_zero import get_fp32_state_dict_from_zero_checkpoint as safe_fp32_state_dict

    zero = dict(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    engine = _engine(build(Full), safe, ws, **zero)
    before = _fit(engine, 2)
    engine.save_checkpoint(ckpt_dir, tag="t")
    uninterrupted = _fit(engine, 2)
    sd16 = engine._zero3_consolidated_16bit_state_dict()
    gathered = _gathered(engine.module)

    resumed_engine = _engine(build(Full, seed=1), safe, ws, **zero)
    resumed_engine.load_checkpoint(ckpt_dir, tag="t")
    resumed = _fit(resumed_engine, 2)

    deepspeed.comm.barrier()
    loads = {}
    if deepspeed.comm.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = (safe_fp32_state_dict if safe else get_fp32_state_dict_from_zero_checkpoint)(ckpt_dir, tag="t")
        for name, sd in (("fp32", fp32), ("16bit", sd16)):
            fresh = build(Full, seed=2)
            fresh.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
            loads[name] = {k: tuple(v.shape) for k, v in sd.items()}
    deepspeed.comm.barrier()
    return {"losses": before + uninterrupted, "uninterrupted": uninterrupted, "resumed": resumed,
            "params": gathered, "loads": loads}


SCENARIOS: dict[str, Callable[..., dict]] = {
    name[2:]: fn for name, fn in globals().items() if name.startswith("s_") and callable(fn)
}
SAFE_ONLY = {"count", "zero_init_installed"}
#: Not run without the zero-element parameters: ``count`` compares with and without them itself, ``control`` has none.
NOT_BARE = {"count", "control"}


def _run_scenarios(safe: bool, world_size: int, ckpt_dir: str, bare: bool = False) -> dict[str, dict]:
    """``bare``: stock DeepSpeed on every scenario's model without its zero-element parameters (``_BARE``)."""
    global _BARE
    out = {}
    _BARE = bare
    try:
        for name, fn in SCENARIOS.items():
            if (not safe and name in SAFE_ONLY and not bare) or (bare and name in NOT_BARE):
                continue
            try:
                which = "bare" if bare else "safe" if safe else "stock"
                kwargs = {"ckpt_dir": f"{ckpt_dir}/{which}"} if name == "checkpoint" else {}
                out[name] = fn(safe, world_size, **kwargs)
            except Exception as e:  # noqa: BLE001 - the stock runs are expected to fail; the test reads the text
                out[name] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        _BARE = False
    return out


# ---------------------------------------------------------------------------------------------- tests

_CACHE: dict[tuple[bool, int, bool], list[dict]] = {}


@pytest.fixture(scope="module")
def results(ranks, tmp_path_factory):
    def get(safe: bool, world_size: int, bare: bool = False) -> list[dict]:
        key = (safe, world_size, bare)
        if key not in _CACHE:
            ckpt = str(tmp_path_factory.mktemp(f"ckpt_ws{world_size}"))
            _CACHE[key] = ranks.run(world_size, _run_scenarios, safe=safe, world_size=world_size, ckpt_dir=ckpt,
                                    bare=bare, timeout=900)
        return _CACHE[key]
    yield get
    _CACHE.clear()


NOT_AVAILABLE = "'status': 'NOT_AVAILABLE', 'numel': 0"
EMPTY_CAT = "torch.cat(): expected a non-empty list of Tensors"
HALF_WEIGHTS = "to have the same dtype"


def _quantized_gather_keeps_dtype() -> bool:
    """DeepSpeed 0.19.8 dequantizes gathered weights to the parameter's dtype; older releases hand a
    bf16 model fp16 weights at world size >= 2 (``expected m1 and m2 to have the same dtype``), with
    or without zero-element parameters."""
    import inspect

    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    return "dtype" in inspect.signature(CUDAQuantizer.dequantize).parameters


STOCK_ERRORS = {
    "only_trainable": {1: NOT_AVAILABLE, 2: NOT_AVAILABLE},
    "only_frozen": {1: NOT_AVAILABLE, 2: NOT_AVAILABLE},
    "only_fp32": {1: NOT_AVAILABLE, 2: NOT_AVAILABLE},
    "mixed_bucket": {2: EMPTY_CAT},  # at world size 1 DeepSpeed copies instead of gathering, and copes
    "prefetch_chain": {1: NOT_AVAILABLE, 2: NOT_AVAILABLE},
    "offload": {1: NOT_AVAILABLE, 2: EMPTY_CAT},
    "persist_large": {1: NOT_AVAILABLE, 2: EMPTY_CAT},
    "quant_nontrainable": {1: "ZeroDivisionError", 2: "ZeroDivisionError"},
    "quant_weights": {1: NOT_AVAILABLE, 2: NOT_AVAILABLE if _quantized_gather_keeps_dtype() else HALF_WEIGHTS},
    "eval_no_grad": {1: NOT_AVAILABLE, 2: EMPTY_CAT},
    "inference_only": {1: NOT_AVAILABLE, 2: EMPTY_CAT},
    "zero_init": {1: NOT_AVAILABLE, 2: EMPTY_CAT},
    "zero_init_quant": {1: "ZeroDivisionError", 2: "ZeroDivisionError"},
    "checkpoint": {1: NOT_AVAILABLE, 2: EMPTY_CAT},
}


def _ok(result: dict, name: str) -> dict:
    assert "error" not in result, f"{name}: {result.get('error')}"
    return result


def _assert_trained(result: dict, name: str, steps: int | None = None) -> None:
    _ok(result, name)
    losses = torch.tensor(result["losses"])
    if steps is not None:
        assert len(losses) == steps
    assert torch.isfinite(losses).all(), (name, result["losses"])
    assert losses[-1] < losses[0], (name, result["losses"])


def _empty_params(params: dict) -> dict:
    return {n: v for n, v in params.items() if v[0] and v[0][0] == 0}


def _assert_real_shapes(result: dict, name: str) -> None:
    params = result["params"]
    empty = _empty_params(params)
    assert empty and all(shape == EMPTY_SHAPE for shape, _ in empty.values()), (name, params)
    sized_dtypes = {dtype for n, (shape, dtype) in params.items() if n not in empty}
    assert {dtype for _, dtype in empty.values()} <= sized_dtypes, (name, params)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", sorted(STOCK_ERRORS))
def test_stock_deepspeed_fails_on_zero_element_params(results, name, world_size):
    expected = STOCK_ERRORS[name].get(world_size)
    result = results(False, world_size)[0][name]
    if expected is None:  # stock copes at this world size: it must then agree with safe_zero
        safe = results(True, world_size)[0][name]
        assert "error" not in result, result
        assert result.get("losses", result.get("evals")) == safe.get("losses", safe.get("evals"))
        return
    assert "error" in result, f"{name} at world size {world_size} no longer fails on stock DeepSpeed: {result}"
    assert expected in result["error"], result["error"]


TRAINED = ["only_trainable", "only_frozen", "only_fp32", "mixed_bucket", "prefetch_chain", "offload",
           "persist_large", "quant_nontrainable", "quant_weights", "eval_no_grad", "zero_init", "zero_init_quant",
           "zero_init_installed"]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", TRAINED)
def test_safe_zero_trains_zero_element_params(results, name, world_size):
    # persist_large at world size 2 once gave an inf loss on 0.18.9: the unwaited persistent gather that
    # fixes/coalesced_gather_wait.py now completes (tests/fixes/test_coalesced_gather_wait.py forces it).
    per_rank = [r[name] for r in results(True, world_size)]
    if name == "quant_weights" and world_size == 2 and not _quantized_gather_keeps_dtype():
        # This DeepSpeed's quantized gather breaks every bf16 model at world size 2 (a sized
        # weight comes back fp16): safe_zero gets past the zero-element layer and stops there too.
        assert all(HALF_WEIGHTS in r.get("error", "") for r in per_rank), per_rank
        return
    for result in per_rank:
        _assert_trained(result, name, steps=2 if name == "eval_no_grad" else 3)
        _assert_real_shapes(result, name)
    assert per_rank[0]["losses"] == per_rank[-1]["losses"]
    if name == "eval_no_grad":
        assert all(torch.isfinite(torch.tensor(r["evals"])).all() for r in per_rank)
    if name == "zero_init_installed":
        assert per_rank[0]["routed"] and per_rank[0]["restored"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_safe_zero_inference_only_engine(results, world_size):
    for result in results(True, world_size):
        _ok(result["inference_only"], "inference_only")
        evals = result["inference_only"]["evals"]
        assert torch.isfinite(torch.tensor(evals)).all() and len(set(evals)) == 1, evals
        _assert_real_shapes(result["inference_only"], "inference_only")


@pytest.mark.parametrize("world_size", [1, 2])
def test_zero_element_params_add_no_collectives(results, world_size):
    result = _ok(results(True, world_size)[0]["count"], "count")
    (without, losses), (with_empties, losses_with) = result["k0_bucketNone"], result["k3_bucketNone"]
    assert with_empties == without, "per-step collectives differ with 3 zero-element submodules"
    assert losses_with == losses, "the zero-element submodules changed the losses"
    if world_size == 2:  # the count is real: parameters are gathered every step
        assert all(step.get("all_gather_into_tensor", 0) > 0 for step in without), without
    # A tiny prefetch bucket: DeepSpeed's prefetcher walks past the (already available) empty
    # parameters and may coalesce two sized gathers into one, never more; the same bytes move.
    (without, losses), (with_empties, losses_with) = result["k0_bucket16"], result["k3_bucket16"]
    assert losses_with == losses
    for step_without, step_with in zip(without, with_empties):
        assert step_with.get("gathered_elements") == step_without.get("gathered_elements"), (without, with_empties)
        for kind, n in step_with.items():
            assert n <= step_without.get(kind, 0), (kind, without, with_empties)


@pytest.mark.parametrize("world_size", [1, 2])
def test_control_model_is_bit_identical_under_safe_zero(results, world_size):
    stock = results(False, world_size)[0]["control"]
    safe = results(True, world_size)[0]["control"]
    _assert_trained(safe, "control", steps=3)
    assert stock["losses"] == safe["losses"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_checkpoint_round_trip_and_consolidation(results, world_size):
    per_rank = [r["checkpoint"] for r in results(True, world_size)]
    for result in per_rank:
        _assert_trained(result, "checkpoint", steps=4)
        assert result["resumed"] == result["uninterrupted"], result
        _assert_real_shapes(result, "checkpoint")
    loads = per_rank[0]["loads"]
    expected = {name: shape for name, (shape, _) in per_rank[0]["params"].items()}
    assert loads["fp32"] == expected and loads["16bit"] == expected, loads


#: Every scenario with zero-element parameters that trains or evaluates, against the same model without them.
BARE_COMPARED = TRAINED + ["inference_only", "checkpoint"]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", BARE_COMPARED)
def test_safe_zero_trains_zero_element_models_as_stock_trains_them_without_those_params(results, name, world_size):
    """The numbers' reference: stock DeepSpeed on the same model, seeds, data and config minus its zero-element
    parameters (and the exact zeros they add), which it trains. Equal to the bit: losses, evaluations and every
    sized parameter's trained value."""
    bare = [r[name] for r in results(False, world_size, bare=True)]
    safe = [r[name] for r in results(True, world_size)]
    if name == "quant_weights" and world_size == 2 and not _quantized_gather_keeps_dtype():
        # This DeepSpeed's quantized gather breaks every bf16 model at world size 2, with or without them.
        assert all(HALF_WEIGHTS in r.get("error", "") for r in bare + safe), (bare, safe)
        return
    for without, with_ in zip(bare, safe):
        _ok(without, f"{name} without zero-element parameters")
        _ok(with_, name)
        for key in ("losses", "evals", "resumed"):
            assert with_.get(key) == without.get(key), (key, with_.get(key), without.get(key))
        assert "losses" in without or "evals" in without
        # Stock reads the reference's values through its coalesced all-gather, which on a DeepSpeed with the
        # coalesced_gather_wait defect (< 0.19.8) may not have landed at 2 ranks: compare them where it has not.
        if "values" in without and not (world_size > 1 and coalesced_gather_wait.FIX.needed(DEEPSPEED_VERSION)):
            assert with_["values"].keys() == without["values"].keys()
            unequal = [n for n in without["values"] if not torch.equal(with_["values"][n], without["values"][n])]
            assert not unequal, f"{name}: trained values differ from the model without its empty parameters: {unequal}"
