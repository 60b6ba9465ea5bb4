"""The GPU check (``benchmarks/gpu_check.sh`` -> ``benchmarks/gpu/check.py``) without a GPU.

On CPU the script must stop at ``no CUDA: skipped`` with a non-zero exit. Its judging must fail where it
should: each judge gets made-up records (stock no longer failing, safe_zero misaligned, off the reference,
...), and the grouped_mm legs run for real on the CPU accelerator with CUDA's alignment check put in
front of the CPU kernel (``bodies.cuda_like``), so stock's misaligned expert weight is refused as CUDA
refuses it and safe_zero's layout is not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from packaging.version import Version

from benchmarks.gpu import check as script
from benchmarks.gpu.checks import BY_NAME, CHECKS, EXPERT_SHAPE, judge
from safe_zero._compat import DEEPSPEED_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The GPU check runs on the main leg's DeepSpeed only.
pytestmark = pytest.mark.main_leg_only


# ------------------------------------------------------------------------------------------ the script


def test_script_on_cpu_says_no_cuda_skipped_and_exits_non_zero(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run the real checks")
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHON=sys.executable, DS_ACCELERATOR="cpu")
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--report", str(report)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == script.NO_CUDA_EXIT != 0, done.stdout + done.stderr
    assert "no CUDA: skipped" in done.stdout
    written = json.loads(report.read_text())
    assert written["status"] == "skipped"
    assert [c["name"] for c in written["checks"]] == [c.name for c in CHECKS]
    assert all(c["status"] == "skip" and c["proves"] for c in written["checks"])


def test_every_check_says_what_it_proves_and_how_it_fails():
    from benchmarks.gpu import bodies

    assert len(BY_NAME) == len(CHECKS)
    for check in CHECKS:
        assert len(check.proves) > 40 and check.fails_how, check.name
        assert check.world_size in (1, 2)
        names = [leg.name for leg in check.legs]
        assert len(set(names)) == len(names)
        for leg in check.legs:
            assert callable(getattr(bodies, leg.body)), leg.body
        # Both halves of every claim: stock shows the defect, safe_zero trains.
        assert any(n.startswith("stock_") for n in names) and any(n.startswith("safe_") for n in names), check.name
    assert {c.world_size for c in CHECKS} == {1, 2}, "the script must run 1- and 2-rank NCCL checks"
    table = script.markdown_table()
    assert all(f"`{c.name}`" in table for c in CHECKS)


def test_readme_lists_every_gpu_check():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    missing = [c.name for c in CHECKS if f"`{c.name}`" not in readme]
    assert not missing, f"README's GPU check table lacks {missing} (benchmarks/gpu/check.py --list prints it)"


def test_report_path_argument_then_out_then_default(tmp_path):
    assert script.report_path(str(tmp_path / "r.json"), {"OUT": "/elsewhere"}) == str(tmp_path / "r.json")
    assert script.report_path(None, {"OUT": str(tmp_path)}) == str(tmp_path / "gpu_check_report.json")
    assert script.report_path(None, {}) == os.path.join(ROOT, "benchmarks", "gpu", "report.json")


def test_the_builds_get_torch_cuda_arch_list_without_arch_suffixes(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX 10.0f")
    assert script._env()["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX 10.0"
    assert script.arch_list_for_deepspeed("9.0") == "9.0"


@pytest.mark.skipif(DEEPSPEED_VERSION < Version("0.19.0"),
                    reason="DeepSpeed < 0.19 JIT-builds for the visible GPUs and does not read TORCH_CUDA_ARCH_LIST")
def test_an_arch_list_deepspeeds_builder_cannot_parse_is_given_it_without_suffixes(monkeypatch):
    """The H200 image sets TORCH_CUDA_ARCH_LIST=9.0a, on which every DeepSpeed JIT build failed (2026-12-04)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX 10.0f")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", script._env()["TORCH_CUDA_ARCH_LIST"])
    builder.compute_capability_args()


def test_report_writer_and_exit_status(tmp_path):
    path = str(tmp_path / "deep" / "report.json")
    script.write_json(path, script.skipped_report("no CUDA"))
    assert json.loads(open(path).read())["checks"][0]["status"] == "skip"
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.endswith(".tmp")]
    entry = lambda status: script.check_entry(CHECKS[0], status)  # noqa: E731
    assert script.overall([entry("pass"), entry("skip")]) == "pass"
    assert script.overall([entry("pass"), entry("fail")]) == "fail"
    assert script.overall([entry("skip"), entry("error")]) == "fail"
    assert script.exit_code({"status": "pass"}) == 0
    assert script.exit_code({"status": "fail"}) == script.FAILED_EXIT
    assert script.exit_code({"status": "skipped"}) == script.NO_CUDA_EXIT


# ------------------------------------------------------------------------------------- made-up records

FACTS = {"deepspeed": "0.19.8", "world_size": 2, "zero_element_groups_needed": False, "bf16_optimizer_reachable": True,
         "all_reduce_fetch_refused": False, "quantized_gather_keeps_dtype": True}
PROBE = {"function": "torch.nn.functional.grouped_mm", "device": "cuda:0", "misaligned_error": "expected data_ptr to "
         "be aligned to 16 bytes", "aligned_error": None, "checks_alignment": True}
LOSSES = [0.3, 0.2, 0.1]
WRAPPERS = {"zero2": "DeepSpeedZeroOptimizer", "bf16_optimizer": "BF16_Optimizer", "zero3": "DeepSpeedZeroOptimizer_Stage3",
            "zero3_all_reduce": "DeepSpeedZeroOptimizer_Stage3", "fused_stage0": "FP16_Optimizer"}


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


ONE = BY_NAME["grouped_mm_one_rank"]
ROUTES = ["zero2", "bf16_optimizer", "zero3"]


def test_grouped_mm_passes_on_stock_misaligned_and_refused_and_safe_aligned():
    verdict = judge(ONE, _gmm_legs(ROUTES), dict(FACTS, world_size=1))
    assert verdict.status == "pass", verdict.reasons
    assert verdict.stock_as_expected and verdict.safe_zero_ok


@pytest.mark.parametrize("stock", [
    _stock_gmm("zero3", offset=0, error=None),  # stock became aligned
    _stock_gmm("zero3", offset=6, error=None),  # misaligned, but grouped_mm took it although it checks alignment
])
def test_grouped_mm_fails_when_stock_no_longer_shows_the_defect(stock):
    verdict = judge(ONE, _gmm_legs(ROUTES, stock_zero3=[stock]), dict(FACTS, world_size=1))
    assert verdict.status == "fail"
    assert any("stock no longer shows" in r and "update the claim" in r for r in verdict.reasons), verdict.reasons


@pytest.mark.parametrize("safe,why", [
    (_safe_gmm("zero2", offset=8), "off the grid"),
    (_safe_gmm("zero2", losses=[0.3, 0.31, 0.32]), "did not fall"),
    (_safe_gmm("zero2", losses=[0.3, float("nan"), 0.1]), "non-finite"),
    (dict(_safe_gmm("zero2"), error="AlignmentError: ...", where="initialize"), "AlignmentError"),
    (dict(_safe_gmm("zero2"), standalone_error="RuntimeError: expected data_ptr to be aligned to 16 bytes"), "engine's weight"),
    (dict(_safe_gmm("zero2"), wrapper_mro=["FP16_UnfusedOptimizer"]), "not DeepSpeedZeroOptimizer"),
    (dict(_safe_gmm("zero2"), shape=[1024]), "shape"),
])
def test_grouped_mm_fails_when_safe_zero_does_not_train_aligned(safe, why):
    verdict = judge(ONE, _gmm_legs(ROUTES, safe_zero2=[safe]), dict(FACTS, world_size=1))
    assert verdict.status == "fail" and not verdict.safe_zero_ok
    assert any(why in r for r in verdict.reasons), verdict.reasons


def test_grouped_mm_on_a_gpu_whose_kernel_does_not_check_shows_the_misalignment_only():
    probe = dict(PROBE, misaligned_error=None, checks_alignment=False)
    stock = _stock_gmm("zero2", error=None)
    verdict = judge(ONE, _gmm_legs(ROUTES, kernel=[probe], stock_zero2=[stock]), dict(FACTS, world_size=1))
    assert verdict.status == "pass", verdict.reasons
    assert any("no bf16 fast path" in n for n in verdict.notes)


def test_grouped_mm_two_ranks_expects_stock_all_gather_aligned():
    two = BY_NAME["grouped_mm_two_ranks"]
    legs = {"kernel": [PROBE] * 2,
            "stock_zero3_all_reduce": [_stock_gmm("zero3_all_reduce", 8)] * 2,
            "safe_zero3_all_reduce": [_safe_gmm("zero3_all_reduce")] * 2,
            "stock_zero3": [dict(_stock_gmm("zero3", 0, None), losses=LOSSES)] * 2,  # stock's all-gather: aligned
            "safe_zero3": [_safe_gmm("zero3")] * 2}
    assert judge(two, legs, FACTS).status == "pass"
    legs["stock_zero3"] = [_stock_gmm("zero3", 8, None)] * 2
    verdict = judge(two, legs, FACTS)
    assert verdict.status == "fail" and any("expected to keep grouped_mm weights aligned" in r for r in verdict.reasons)


def test_a_leg_without_a_record_is_an_error_not_a_pass():
    legs = _gmm_legs(ROUTES, safe_zero3=[None])
    verdict = judge(ONE, legs, dict(FACTS, world_size=1))
    assert verdict.status == "error" and "no record of leg(s) safe_zero3" in verdict.reasons[0]


FP16 = BY_NAME["fp16_stage0_zero_sized"]


def _fp16(kind: str, *, shapes: list | None = None, error: str | None = None, empty_in_groups: bool = False) -> dict:
    wrapper = "FP16_Optimizer" if kind == "fused" else "FP16_UnfusedOptimizer"
    return {"wrapper_mro": [wrapper], "losses": [] if error else LOSSES, "shapes": shapes or [[0, 8]] * 4,
            "error": error, "empty_in_groups": empty_in_groups}


def _fp16_legs(**changes) -> dict:
    legs = {f"{who}_{kind}": [_fp16(kind)] for who in ("stock", "safe") for kind in ("fused", "unfused")}
    legs.update(changes)
    return legs


def test_fp16_stage0_follows_the_fix_table_both_ways():
    assert judge(FP16, _fp16_legs(), FACTS).status == "pass"  # 0.19.8: stock trains, as the table says
    failing = _fp16_legs(stock_fused=[_fp16("fused", error="KeyError: 3")])
    verdict = judge(FP16, failing, FACTS)
    assert verdict.status == "fail" and any("0.19.8 fixed it" in r for r in verdict.reasons)
    older = dict(FACTS, deepspeed="0.19.7", zero_element_groups_needed=True)
    verdict = judge(FP16, _fp16_legs(), older)  # < 0.19.8 and stock shows nothing
    assert verdict.status == "fail" and any("stock no longer shows" in r for r in verdict.reasons)
    shown = _fp16_legs(stock_fused=[_fp16("fused", shapes=[[0, 8], [0]], empty_in_groups=True)])
    assert judge(FP16, shown, older).status == "pass"
    lost = _fp16_legs(safe_fused=[_fp16("fused", shapes=[[0, 8], [0], [0], [0]])])
    assert judge(FP16, lost, FACTS).status == "fail"


Q2 = BY_NAME["quantizer_two_ranks"]


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
    assert judge(Q2, _quant_legs(), FACTS).status == "pass"
    verdict = judge(Q2, _quant_legs(stock_weights=[_quant()] * 2), FACTS)
    assert verdict.status == "fail" and any("stock no longer shows" in r for r in verdict.reasons)
    elsewhere = dict(_quant("ZeroDivisionError: division by zero"), quantize_calls={"sized": 0, "empty": 0})
    assert judge(Q2, _quant_legs(stock_nontrainable=[elsewhere] * 2), FACTS).status == "fail"  # not the quantizer's
    verdict = judge(Q2, _quant_legs(safe_weights=[_quant(sized=0)] * 2), FACTS)
    assert verdict.status == "fail" and any("quantizer never ran" in r for r in verdict.reasons)
    verdict = judge(Q2, _quant_legs(safe_nontrainable=[_quant(), _quant(losses=[0.3, 0.2, 0.15])]), FACTS)
    assert verdict.status == "fail" and any("ranks disagree" in r for r in verdict.reasons)


def test_quantizer_one_rank_needs_the_kernel_to_divide_by_zero():
    q1 = BY_NAME["quantizer_one_rank"]
    kernel = {"stock_empty_error": "ZeroDivisionError: integer modulo by zero", "error": None, "sized_equal": True,
              "safe_empty": {"dtype": "torch.int8", "numel": 0, "scales": 0}, "safe_empty_back": {"numel": 0}}
    legs = {"kernel": [kernel], "stock_nontrainable": [_quant("ZeroDivisionError: x")], "safe_nontrainable": [_quant()]}
    assert judge(q1, legs, FACTS).status == "pass"
    legs["kernel"] = [dict(kernel, stock_empty_error=None)]
    assert judge(q1, legs, FACTS).status == "fail"


DDP = BY_NAME["ddp_exact_two_ranks"]


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
    assert judge(DDP, _ddp_legs(), FACTS).status == "pass"
    verdict = judge(DDP, _ddp_legs(safe_mixed_moe=[_ddp(max_error=2e-5)] * 2), FACTS)
    assert verdict.status == "fail" and any("not DDP-exact" in r for r in verdict.reasons)
    verdict = judge(DDP, _ddp_legs(stock_mixed_moe=[_ddp()] * 2), FACTS)
    assert verdict.status == "fail" and any("stock no longer shows" in r for r in verdict.reasons)
    verdict = judge(DDP, _ddp_legs(stock_moe=[_ddp(max_error=1e-6)] * 2), FACTS)  # stock became DDP-exact
    assert verdict.status == "fail" and any("stock no longer shows" in r for r in verdict.reasons)
    assert judge(DDP, _ddp_legs(stock_moe=[_ddp(max_error=0.05)] * 2), FACTS).status == "pass"  # silently wrong
    verdict = judge(DDP, _ddp_legs(safe_mixed_moe=[_ddp(), None]), FACTS)
    assert verdict.status == "error"


# --------------------------------------------------------------------- the grouped_mm legs, run on CPU


def _routes_on_cpu(routes: list) -> dict:
    from benchmarks.gpu import bodies

    legs = {"kernel": [bodies.grouped_mm_kernel_probe(kernel="cuda_like")]}
    for route in routes:
        for who, safe in (("stock", False), ("safe", True)):
            legs[f"{who}_{route}"] = [bodies.run_leg(bodies.grouped_mm_leg, route=route, safe=safe, kernel="cuda_like")]
    return {"legs": legs, "facts": bodies.facts()}


def test_grouped_mm_legs_on_cpu_with_cudas_alignment_check(ranks):
    """The real legs, CPU kernel behind CUDA's data_ptr check: stock ZeRO-2 and ZeRO-3 (one rank) are refused,
    safe_zero trains aligned; the same records with stock and safe_zero swapped fail the check."""
    from benchmarks.gpu.checks import Check, _grouped_mm_legs, _judge_grouped_mm

    routes = ["zero2", "zero3"]
    got = ranks.run(1, _routes_on_cpu, routes=routes)[0]
    legs, facts = got["legs"], got["facts"]
    check = Check(name="grouped_mm_cpu", world_size=1, proves=ONE.proves, fails_how=ONE.fails_how,
                  legs=_grouped_mm_legs(routes), judge=_judge_grouped_mm(routes))
    verdict = judge(check, legs, facts)
    assert verdict.status == "pass", (verdict.reasons, legs)
    for route in routes:
        assert "aligned to 16 bytes" in legs[f"stock_{route}"][0]["error"]
        assert set(legs[f"safe_{route}"][0]["calls"]) == {0}
    swapped = dict(legs, **{f"safe_{r}": legs[f"stock_{r}"] for r in routes},
                   **{f"stock_{r}": legs[f"safe_{r}"] for r in routes})
    verdict = judge(check, swapped, facts)
    assert verdict.status == "fail"
    assert any("stock no longer shows" in r for r in verdict.reasons)
    assert any(r.startswith("safe_zero on zero3") for r in verdict.reasons)
