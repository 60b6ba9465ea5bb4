"""The GPU checks without a GPU: what of them runs on CPU.

Without CUDA the runner must stop at ``no CUDA: skipped`` with exit status 2, and pytest must skip the ``gpu`` tests
and report them. The claims must fail where they should: each gets made-up records (stock no longer failing,
safe_zero misaligned, off the reference, ...), and the grouped_mm legs run for real on the CPU accelerator with
CUDA's alignment check put in front of the CPU kernel (``legs.cuda_like``), so stock's misaligned expert weight is
refused as CUDA refuses it and safe_zero's layout is not.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from safe_zero._compat import DEEPSPEED_VERSION
from tests.gpu import __main__ as runner
from tests.gpu import claims
from tests.gpu.claims import EXPERT_SHAPE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))

# The GPU checks are developed against the main leg's DeepSpeed.
pytestmark = pytest.mark.main_leg_only


def _gpu_tests() -> dict[str, str]:
    """The ``gpu`` tests of test_gpu.py by name (``test_`` left off), with their docstrings."""
    with open(os.path.join(HERE, "test_gpu.py")) as f:
        tree = ast.parse(f.read())
    return {node.name[len("test_"):]: ast.get_docstring(node) or "" for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


# ------------------------------------------------------------------------------------------ the runner


def test_runner_on_cpu_says_no_cuda_skipped_and_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the runner would run the real checks")
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--report", str(report)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == runner.NO_CUDA_EXIT == 2, done.stdout + done.stderr
    assert "no CUDA: skipped" in done.stdout
    assert json.loads(report.read_text())["status"] == "skipped"


def test_without_cuda_pytest_skips_every_gpu_check_and_reports_it(tmp_path):
    """The ``gpu`` tests as the normal suite collects them (``DS_ACCELERATOR=cpu``): skipped, and the report hook
    names each with its outcome."""
    report = tmp_path / "report.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", SAFE_ZERO_GPU_REPORT=str(report))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                           os.path.join(HERE, "test_gpu.py")], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    written = json.loads(report.read_text())
    assert written["status"] == "pass"
    assert {t["test"]: t["outcome"] for t in written["tests"]} == {f"test_{n}": "skipped" for n in _gpu_tests()}
    assert all("needs CUDA" in t["failure"] for t in written["tests"])


def test_every_gpu_check_says_what_it_proves_and_the_docs_list_it():
    checks = _gpu_tests()
    assert len(checks) == 7
    assert all(len(doc) > 80 for doc in checks.values()), checks
    doc = os.path.join(ROOT, "docs", "gpu_checks.md")
    with open(doc if os.path.exists(doc) else os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    missing = [name for name in checks if f"`{name}`" not in text]
    assert not missing, f"the GPU check table lacks {missing} (tests/gpu/test_gpu.py without the test_ prefix)"


def test_report_path_argument_then_out_then_default(tmp_path):
    assert runner.report_path(str(tmp_path / "r.json"), {"OUT": "/elsewhere"}) == str(tmp_path / "r.json")
    assert runner.report_path(None, {"OUT": str(tmp_path)}) == str(tmp_path / "gpu_check_report.json")
    assert runner.report_path(None, {}) == os.path.join(ROOT, ".bench", "gpu_check_report.json")


def test_the_checks_get_torch_cuda_arch_list_without_arch_suffixes():
    env = runner.gpu_env("r.json", {"TORCH_CUDA_ARCH_LIST": "8.0;9.0a+PTX 10.0f", "DS_ACCELERATOR": "cpu"})
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX 10.0"
    assert env["DS_ACCELERATOR"] == "cuda" and env["SAFE_ZERO_GPU_REPORT"] == "r.json"
    assert runner.arch_list_for_deepspeed("9.0") == "9.0"


@pytest.mark.skipif(DEEPSPEED_VERSION < Version("0.19.0"),
                    reason="DeepSpeed < 0.19 JIT-builds for the visible GPUs and does not read TORCH_CUDA_ARCH_LIST")
def test_an_arch_list_deepspeeds_builder_cannot_parse_is_given_it_without_suffixes(monkeypatch):
    """Hopper images set TORCH_CUDA_ARCH_LIST=9.0a, on which every DeepSpeed JIT build fails."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX 10.0f")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", runner.arch_list_for_deepspeed("8.0;9.0a+PTX 10.0f"))
    builder.compute_capability_args()


# ------------------------------------------------------------------------------------- made-up records

FACTS = {"deepspeed": "0.19.8", "world_size": 2, "zero_element_groups_needed": False, "bf16_optimizer_reachable": True,
         "all_reduce_fetch_refused": False, "quantized_gather_keeps_dtype": True}
PROBE = {"function": "torch.nn.functional.grouped_mm", "device": "cuda:0", "misaligned_error": "expected data_ptr to "
         "be aligned to 16 bytes", "aligned_error": None, "checks_alignment": True}
LOSSES = [0.3, 0.2, 0.1]
WRAPPERS = claims.ROUTE_WRAPPERS


def _stock_gmm(route: str, offset: int = 6, error: str | None = "RuntimeError: expected data_ptr to be aligned to 16 "
               "bytes") -> dict:
    return {"route": route, "wrapper_mro": [WRAPPERS[route]], "init_offset": offset, "calls": [offset], "losses": [],
            "error": error, "shape": EXPERT_SHAPE}


def _safe_gmm(route: str, offset: int = 0, losses: list = LOSSES) -> dict:
    return {"route": route, "wrapper_mro": ["Safe" + WRAPPERS[route], WRAPPERS[route]], "init_offset": offset,
            "calls": [offset] * 3, "losses": losses, "standalone_error": None, "shape": EXPERT_SHAPE}


def _gmm_legs(routes: list, **changes) -> dict:
    legs = {"kernel": [PROBE]}
    for route in routes:
        legs[f"stock_{route}"] = [_stock_gmm(route)]
        legs[f"safe_{route}"] = [_safe_gmm(route)]
    legs.update(changes)
    return legs


ROUTES = ["zero2", "bf16_optimizer", "zero3"]
ONE_RANK = dict(FACTS, world_size=1)


def _grouped_mm(legs: dict, facts: dict = ONE_RANK, routes: list = ROUTES, **kwargs) -> list[str]:
    return claims.grouped_mm(legs, facts, routes, **kwargs)


def test_grouped_mm_holds_on_stock_misaligned_and_refused_and_safe_aligned():
    assert _grouped_mm(_gmm_legs(ROUTES)) == []


@pytest.mark.parametrize("stock", [
    _stock_gmm("zero3", offset=0, error=None),  # stock became aligned
    _stock_gmm("zero3", offset=6, error=None),  # misaligned, but grouped_mm took it although it checks alignment
])
def test_grouped_mm_fails_when_stock_no_longer_shows_the_defect(stock):
    problems = _grouped_mm(_gmm_legs(ROUTES, stock_zero3=[stock]))
    assert any("stock no longer shows" in p and "update the claim" in p for p in problems), problems


@pytest.mark.parametrize("safe,why", [
    (_safe_gmm("zero2", offset=8), "off the grid"),
    (_safe_gmm("zero2", losses=[0.3, 0.31, 0.32]), "did not fall"),
    (_safe_gmm("zero2", losses=[0.3, float("nan"), 0.1]), "non-finite"),
    (dict(_safe_gmm("zero2"), error="AlignmentError: ...", where="initialize"), "AlignmentError"),
    (dict(_safe_gmm("zero2"), standalone_error="RuntimeError: expected data_ptr to be aligned to 16 bytes"),
     "engine's weight"),
    (dict(_safe_gmm("zero2"), wrapper_mro=["FP16_UnfusedOptimizer"]), "not DeepSpeedZeroOptimizer"),
    (dict(_safe_gmm("zero2"), shape=[1024]), "shape"),
    (None, "no record"),
])
def test_grouped_mm_fails_when_safe_zero_does_not_train_aligned(safe, why):
    problems = _grouped_mm(_gmm_legs(ROUTES, safe_zero2=[safe]))
    assert any(p.startswith("safe_zero on zero2") and why in p for p in problems), problems


def test_grouped_mm_on_a_gpu_whose_kernel_does_not_check_needs_the_misalignment_only():
    probe = dict(PROBE, misaligned_error=None, checks_alignment=False)
    assert _grouped_mm(_gmm_legs(ROUTES, kernel=[probe], stock_zero2=[_stock_gmm("zero2", error=None)])) == []
    problems = _grouped_mm(_gmm_legs(ROUTES, kernel=[dict(PROBE, aligned_error="RuntimeError: shapes")]))
    assert any("fails on an aligned bf16 weight" in p for p in problems)


def test_grouped_mm_two_ranks_expects_stock_all_gather_aligned():
    routes, aligned = ["zero3_all_reduce", "zero3"], ("zero3",)
    legs = {"kernel": [PROBE] * 2,
            "stock_zero3_all_reduce": [_stock_gmm("zero3_all_reduce", 8)] * 2,
            "safe_zero3_all_reduce": [_safe_gmm("zero3_all_reduce")] * 2,
            "stock_zero3": [dict(_stock_gmm("zero3", 0, None), losses=LOSSES)] * 2,  # stock's all-gather: aligned
            "safe_zero3": [_safe_gmm("zero3")] * 2}
    assert _grouped_mm(legs, FACTS, routes, stock_aligned=aligned) == []
    legs["stock_zero3"] = [_stock_gmm("zero3", 8, None)] * 2
    problems = _grouped_mm(legs, FACTS, routes, stock_aligned=aligned)
    assert any("expected to keep grouped_mm weights aligned" in p for p in problems)
    # DeepSpeed < 0.19.8: safe_zero refuses the all-reduce fetch route for grouped_mm weights, as documented.
    refused = dict(FACTS, all_reduce_fetch_refused=True)
    legs.update(stock_zero3=[dict(_stock_gmm("zero3", 0, None), losses=LOSSES)] * 2)
    assert any("documented refusal" in p for p in _grouped_mm(legs, refused, routes, stock_aligned=aligned))
    legs["safe_zero3_all_reduce"] = [{"error": "UnsupportedRoute: stage3_use_all_reduce_for_fetch_params ..."}] * 2
    assert _grouped_mm(legs, refused, routes, stock_aligned=aligned) == []


def _fp16(kind: str, *, shapes: list | None = None, error: str | None = None, empty_in_groups: bool = False) -> dict:
    wrapper = "FP16_Optimizer" if kind == "fused" else "FP16_UnfusedOptimizer"
    return {"wrapper_mro": [wrapper], "losses": [] if error else LOSSES, "shapes": shapes or [[0, 8]] * 4,
            "error": error, "empty_in_groups": empty_in_groups}


def _fp16_legs(**changes) -> dict:
    legs = {f"{who}_{kind}": [_fp16(kind)] for who in ("stock", "safe") for kind in ("fused", "unfused")}
    legs.update(changes)
    return legs


def test_fp16_stage0_follows_the_fix_table_both_ways():
    assert claims.fp16_stage0(_fp16_legs(), FACTS) == []  # 0.19.8: stock trains, as the table says
    problems = claims.fp16_stage0(_fp16_legs(stock_fused=[_fp16("fused", error="KeyError: 3")]), FACTS)
    assert any("0.19.8 fixed it" in p for p in problems)
    older = dict(FACTS, deepspeed="0.19.7", zero_element_groups_needed=True)
    problems = claims.fp16_stage0(_fp16_legs(), older)  # < 0.19.8 and stock shows nothing
    assert any("stock no longer shows" in p for p in problems)
    shown = _fp16_legs(stock_fused=[_fp16("fused", shapes=[[0, 8], [0]], empty_in_groups=True)])
    assert claims.fp16_stage0(shown, older) == []
    lost = _fp16_legs(safe_fused=[_fp16("fused", shapes=[[0, 8], [0], [0], [0]])])
    assert any("expected [0, 8] throughout" in p for p in claims.fp16_stage0(lost, FACTS))
    wrong = _fp16_legs(safe_unfused=[_fp16("fused")])  # the unfused leg reached FP16_Optimizer
    assert any("not FP16_UnfusedOptimizer" in p for p in claims.fp16_stage0(wrong, FACTS))


TWO_MODELS = {"nontrainable": ("ZeroDivisionError",),
              "weights": (claims.EMPTY_CAT, claims.NOT_AVAILABLE, "ZeroDivisionError")}


def _quant(error: str | None = None, sized: int = 2, losses: list = LOSSES, empty_shape: list = [0, 8]) -> dict:
    return {"world_size": 2, "error": error, "losses": [] if error else losses,
            "quantize_calls": {"sized": sized, "empty": 1 if error else 0},
            "shapes": {"dense.weight": [16, 8], "empty.weight": empty_shape}}


def _quant_legs(**changes) -> dict:
    legs = {"stock_nontrainable": [_quant("ZeroDivisionError: integer modulo by zero")] * 2,
            "safe_nontrainable": [_quant()] * 2,
            "stock_weights": [_quant("ValueError: torch.cat(): expected a non-empty list of Tensors")] * 2,
            "safe_weights": [_quant()] * 2}
    legs.update(changes)
    return legs


def test_quantizer_two_ranks_fails_where_it_should():
    assert claims.quantizer(_quant_legs(), FACTS, TWO_MODELS) == []
    problems = claims.quantizer(_quant_legs(stock_weights=[_quant()] * 2), FACTS, TWO_MODELS)
    assert any("stock no longer shows" in p for p in problems)
    elsewhere = dict(_quant("ZeroDivisionError: division by zero"), quantize_calls={"sized": 0, "empty": 0})
    assert claims.quantizer(_quant_legs(stock_nontrainable=[elsewhere] * 2), FACTS, TWO_MODELS)  # not the quantizer's
    problems = claims.quantizer(_quant_legs(safe_weights=[_quant(sized=0)] * 2), FACTS, TWO_MODELS)
    assert any("quantizer never ran" in p for p in problems)
    disagree = _quant_legs(safe_nontrainable=[_quant(), _quant(losses=[0.3, 0.2, 0.15])])
    assert any("ranks disagree" in p for p in claims.quantizer(disagree, FACTS, TWO_MODELS))
    lost = _quant_legs(safe_nontrainable=[_quant(empty_shape=[0])] * 2)
    assert any("zero-element shapes" in p for p in claims.quantizer(lost, FACTS, TWO_MODELS))


def test_quantizer_one_rank_needs_the_kernel_to_divide_by_zero():
    kernel = {"stock_empty_error": "ZeroDivisionError: integer modulo by zero", "error": None, "sized_equal": True,
              "safe_empty": {"dtype": "torch.int8", "numel": 0, "scales": 0}, "safe_empty_back": {"numel": 0}}
    legs = {"kernel": [kernel], "stock_nontrainable": [_quant("ZeroDivisionError: x")], "safe_nontrainable": [_quant()]}
    one = {"nontrainable": ("ZeroDivisionError",)}
    assert claims.quantizer(legs, FACTS, one) == []
    legs["kernel"] = [dict(kernel, stock_empty_error=None)]
    assert any("stock no longer shows" in p for p in claims.quantizer(legs, FACTS, one))
    legs["kernel"] = [dict(kernel, sized_equal=False)]
    assert any("quantizer guard" in p for p in claims.quantizer(legs, FACTS, one))




def _ddp(error: str | None = None, max_error: float = 3e-8, losses: list = LOSSES) -> dict:
    shapes = {"mixed.empty": [0, 8], "head.weight": [1, 8]}
    return {"error": error, "losses": [] if error else losses, "max_error": max_error, "shapes": shapes,
            "expected_shapes": shapes}


def _ddp_legs(**changes) -> dict:
    legs = {"stock_mixed_moe": [_ddp("ValueError: torch.cat(): expected a non-empty list of Tensors")] * 2,
            "safe_mixed_moe": [_ddp(), _ddp(losses=[0.5, 0.4, 0.3])],
            # rank 0 was left in a collective and killed: no record
            "stock_moe": [None, _ddp("RuntimeError: Detected a disagreement on list contents between rank0 and rank1")]}
    legs.update(changes)
    return legs


def test_ddp_exact_fails_where_it_should():
    assert claims.ddp_exact(_ddp_legs(), FACTS) == []
    # The pool's job ended on rank 1's error, rank 0 left in a collective: no records, the job's error.
    left = "job 7 did not finish on all 2 ranks within 150s (finished: [1]); rank 1: RuntimeError: Detected a " \
           "disagreement on list contents between rank0 and rank1"
    assert claims.ddp_exact(_ddp_legs(stock_moe=[]), FACTS, moe_error=left) == []
    problems = claims.ddp_exact(_ddp_legs(safe_mixed_moe=[_ddp(max_error=2e-5)] * 2), FACTS)
    assert any("not DDP-exact" in p for p in problems)
    problems = claims.ddp_exact(_ddp_legs(stock_mixed_moe=[_ddp()] * 2), FACTS)
    assert any("stock no longer shows" in p for p in problems)
    problems = claims.ddp_exact(_ddp_legs(stock_moe=[_ddp(max_error=1e-6)] * 2), FACTS)  # stock became DDP-exact
    assert any("stock no longer shows" in p for p in problems)
    assert claims.ddp_exact(_ddp_legs(stock_moe=[_ddp(max_error=0.05)] * 2), FACTS) == []  # silently wrong
    assert any("rank 1: no record" in p for p in claims.ddp_exact(_ddp_legs(safe_mixed_moe=[_ddp(), None]), FACTS))
    assert any("did not fall" in p for p in claims.ddp_exact(_ddp_legs(safe_mixed_moe=[_ddp(losses=[1, 2, 3])] * 2),
                                                             FACTS))


# --------------------------------------------------------------------- the grouped_mm legs, run on CPU


def test_grouped_mm_legs_on_cpu_with_cudas_alignment_check(ranks):
    """The real legs, CPU kernel behind CUDA's data_ptr check: stock ZeRO-2 and ZeRO-3 (one rank) are refused,
    safe_zero trains aligned; the same records with stock and safe_zero swapped fail the claim."""
    import torch

    if not hasattr(torch.nn.functional, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped_mm kernel (neither F.grouped_mm nor torch._grouped_mm: before 2.8)")
    from tests.gpu import legs as bodies

    routes = ["zero2", "zero3"]
    legs = {"kernel": ranks.run(1, bodies.grouped_mm_kernel_probe, kernel="cuda_like")}
    for route in routes:
        for who, safe in (("stock", False), ("safe", True)):
            legs[f"{who}_{route}"] = ranks.run(1, bodies.grouped_mm_leg, route=route, safe=safe, kernel="cuda_like")
    facts = ranks.run(1, bodies.facts)[0]
    assert claims.grouped_mm(legs, facts, routes) == [], legs
    for route in routes:
        assert "aligned to 16 bytes" in legs[f"stock_{route}"][0]["error"]
        assert set(legs[f"safe_{route}"][0]["calls"]) == {0}
    assert json.dumps(claims.summary(legs["stock_zero2"]))  # what the report keeps of them
    swapped = dict(legs, **{f"safe_{r}": legs[f"stock_{r}"] for r in routes},
                   **{f"stock_{r}": legs[f"safe_{r}"] for r in routes})
    problems = claims.grouped_mm(swapped, facts, routes)
    assert any("stock no longer shows" in p for p in problems)
    assert any(p.startswith("safe_zero on zero3") for p in problems)
