"""The benchmark code keeps working: the bodies ``make bench`` runs, at sizes a test can afford.

Numbers are not asserted here (timed tests are noise); properties are: the timing returns one
step per engine per round, the all-gather count with all-zero-sized submodules equals the count without,
safe_zero's flat order puts every grouped_mm weight on the grid with no padding, and the scaled
models (at the CI=true size, about 200 tensors) have the tensor counts their tables name and
report calls per tensor, collectives and memory.
"""

import contextlib

import pytest

from benchmarks import bodies
from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import flat_buffer_autograd
from tests.models import skip_without_grouped_mm_transformers

# `make bench` runs on the main leg's DeepSpeed only.
pytestmark = pytest.mark.main_leg_only


@pytest.mark.parametrize("stage", [2, 3])
def test_stepped_seconds_times_every_engine_each_round(ranks, stage):
    if stage == 2 and flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")
    engines = (False, False, True, {"find_unused_parameters": False})
    per_rank = ranks.run(2, bodies.stepped_seconds, stage=stage, rounds=3, warmup=1, engines=engines,
                         built_first=2)
    assert len(per_rank) == 2
    for rounds in per_rank:
        assert len(rounds) == 3
        assert all(len(steps) == len(engines) and min(steps) > 0 for steps in rounds)


def test_all_gathers_per_step_equal_with_and_without_empty_submodules(ranks):
    without = ranks.run(2, bodies.all_gathers_per_step, k=0)
    with_empty = ranks.run(2, bodies.all_gathers_per_step, k=4)
    assert without == with_empty
    assert all(count > 0 for per_step in without for count in per_step)


def test_safe_zero_order_aligns_gpt_oss_with_sinks_without_padding():
    skip_without_grouped_mm_transformers()
    from benchmarks.alignment_overhead import gpt_oss, overhead

    # 20 heads: 40-byte attention sinks push every later expert weight 8 bytes off the grid in stock order.
    row = overhead(gpt_oss(64, 32, 8, layers=2, vocab=128, heads=20, kv_heads=4, head_dim=16))
    assert row["grouped_mm weights"] == 4
    assert row["misaligned in stock layout"] > 0
    assert row["misaligned in safe_zero order"] == 0
    assert row["parameter_alignment pad"] <= 15 * row["off-grid params"]


@pytest.mark.parametrize("stage", [2, 3])
def test_safe_zero_adds_collectives_in_the_first_step_only(ranks, stage):
    """gradless_params: in the first step one all-reduce of one byte per trainable parameter (Wide: 4 layers x 2 = 8)
    and the all-gather of every rank's hook order (ZeRO-3: with each parameter's module clock); after it nothing.
    In the first ZeRO-3 step also the module-order agreement, one all-gather per module."""
    if stage == 2 and flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")
    stock = ranks.run(2, bodies.collectives_per_step, stage=stage, safe=False)[0]
    safe = ranks.run(2, bodies.collectives_per_step, stage=stage, safe=True)[0]
    assert len(stock) == len(safe) == 3
    for step, (before, after) in enumerate(zip(stock, safe)):
        extra = {name: after.get(name, 0) - before.get(name, 0) for name in set(before) | set(after)}
        expected = {"all_reduce": 1, "all_reduce_bytes": 8, "all_gather": 1} if step == 0 else {}
        if stage == 3 and step == 0:  # DeepSpeed records its trace: the ranks agree on each of Wide's 4 modules
            expected["all_gather"] += 4
        # Later steps: nothing added, bytes included. The first: the calls, and the agreement's bytes (the sizes of
        # the gathered orders and the module-order all-gathers are the benchmark tables' to show).
        shown = {name: n for name, n in extra.items()
                 if n and (step > 0 or not name.endswith("_bytes") or name == "all_reduce_bytes")}
        assert shown == expected, (step, before, after)


@pytest.mark.parametrize("model, tensors", [("moe", 189), ("moe_rank_dependent", 189), ("transformer", 194)])
def test_scaled_models_have_the_tensor_counts_the_tables_name(model, tensors):
    from safe_zero.leaf_modules import moe_blocks

    described = bodies.describe(model, 200)  # the CI=true size
    assert described["tensors"] == tensors
    module = bodies.build(model, 200)
    if model.startswith("moe"):
        # An experts nn.ModuleList per block: the pattern safe_zero gathers whole under ZeRO-3.
        assert len(moe_blocks(module)) == described["moe_blocks"] == 7
    else:
        assert not moe_blocks(module)
    assert bodies.example_input(module).dtype.is_floating_point


def test_rank_dependent_moe_runs_other_experts_on_each_rank(ranks):
    per_rank = ranks.run(2, bodies.describe, model="moe_rank_dependent", tensors=200)
    assert [r["experts_run"] for r in per_rank] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ranks.run(2, bodies.describe, model="moe", tensors=200)[0]["experts_run"] == list(range(8))


def test_scaled_costs_report_calls_per_tensor_collectives_and_memory(ranks):
    """One small ZeRO-2 run of the body ``make bench`` runs per scaled model, and the tables it renders."""
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")
    from benchmarks import run

    safe = ranks.run(2, bodies.scaled_costs, stage=2, model="moe", tensors=200, steps=2, profile_steps=1)
    stock = ranks.run(2, bodies.scaled_costs, stage=2, model="moe", tensors=200, steps=2, safe=False)[0]
    for r in safe:
        assert r["tensors"] == 189
        assert r["profile"]["calls_per_step"] > 0 and r["profile"]["functions"]
        # safe_zero's own functions only, named by their file under safe_zero/ ("fixes/gradless_params.py:_node").
        assert all(".py:" in f["function"] and not f["function"].startswith("/") for f in r["profile"]["functions"])
        assert r["memory"]["peak_bytes"] > 0
        assert len(r["collectives"]) == 2
    # The first step's agreement: one all-reduce of 1 byte per trainable tensor, on top of stock's.
    first_added = safe[0]["collectives"][0]["all_reduce_bytes"] - stock["collectives"][0]["all_reduce_bytes"]
    assert first_added == 189
    row = {"model": "moe", "size": 200, "stage": 2, **bodies.describe("moe", 200), "median_ratio": 1.0,
           "stock_vs_stock_ratio": 1.0, "rounds": 2, "stock_ms": 1.0, "safe_ms": 1.0, "profile": safe[0]["profile"],
           "memory": safe[0]["memory"], "collectives": {"stock": stock["collectives"],
                                                        "safe_zero": safe[0]["collectives"]}}
    touched = {**row, "model": "moe_rank_dependent",
               "touched": {"median_ratio": 1.02, "stock_vs_stock_ratio": 1.0, "gap_ci95": [0.005, 0.031], "rounds": 2,
                           "stock_ms": 1.0, "safe_ms": 1.02}}
    text = "\n".join(run.scaled_lines({"scaled": {"moe/200/zero2": row, "moe_rank_dependent/200/zero2": touched},
                                        "scaled_machine": "test"}))
    assert "calls per tensor" in text and "B per tensor" in text
    assert run.ROUNDS_NOTE in text and run.PAIRS_NOTE not in text
    # The rank-dependent model's second baseline: stock made right by hand, timed in the same rounds.
    assert "| `moe_rank_dependent`, stock touching the experts each rank skips (trains right) | 189 | ZeRO-2 | 1 ms | " \
           "1 ms | 1.020 (median of 2 rounds) | 1.000 | OVER (+0.020, 95 % interval +0.005 to +0.031) |" in text


def _trained(stage: int, safe: bool, touched: bool, steps: int = 2):
    """The rank-dependent MoE's parameters after ``steps`` steps on a stock or safe_zero engine, fp32, flat."""
    import deepspeed
    import torch

    module = bodies.build("moe_rank_dependent", 60)  # 2 layers of 8 experts
    if touched:
        bodies.touch_unused(module)
    engine = bodies._engine(module, stage, safe)
    x = bodies.example_input(module)
    for _ in range(steps):
        bodies._step(engine, x)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):  # ZeRO-3 holds a partition of each
        return torch.cat([p.detach().float().flatten() for p in params])


def test_stock_touching_unused_experts_trains_what_safe_zero_trains(ranks):
    """The rank-dependent ratio's second baseline is a right one: stock ZeRO-2 with every rank touching the experts it
    does not run (0 x sum) ends bit-identical to safe_zero on the untouched model; stock untouched does not."""
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")
    import torch

    safe = ranks.run(2, _trained, stage=2, safe=True, touched=False)
    touched = ranks.run(2, _trained, stage=2, safe=False, touched=True)
    untouched = ranks.run(2, _trained, stage=2, safe=False, touched=False)
    for rank in range(2):
        assert torch.equal(touched[rank], safe[rank])
        assert not torch.equal(untouched[rank], safe[rank])  # stock reduces one rank's experts into the other's
    # The bench's timing of it: a stock engine on the touched model against a safe_zero one on the model as it is.
    timed = ranks.run(2, bodies.stepped_seconds, stage=2, rounds=2, warmup=1, model="moe_rank_dependent",
                      tensors=60, engines=(bodies.TOUCHED, True))
    assert [len(rounds) for rounds in timed] == [2, 2]


def test_stock_zero3_with_leaf_experts_trains_what_safe_zero_trains(ranks):
    """At ZeRO-3 the rank-dependent row's plain stock baseline is already a right one: with the MoE blocks as leaf
    modules, as the bench sets them, DeepSpeed's leaf-module hook reduces every expert, zero-filled where the rank
    did not run it, so stock untouched ends bit-identical to safe_zero and needs no touched twin."""
    import torch

    safe = ranks.run(2, _trained, stage=3, safe=True, touched=False)
    untouched = ranks.run(2, _trained, stage=3, safe=False, touched=False)
    initial = ranks.run(2, _trained, stage=3, safe=False, touched=False, steps=0)
    for rank in range(2):
        assert torch.equal(untouched[rank], safe[rank])
        assert not torch.equal(untouched[rank], initial[rank])  # the steps moved the weights


def _switched_training(stage: int, model: str, switched: bool, steps: int = 4) -> tuple[list[int], "torch.Tensor"]:
    """``model`` trained ``steps`` steps on a safe_zero engine with safe_zero switched off in every other
    step after the first (``switched``), or on a stock engine: per step, the calls into safe_zero's functions under
    cProfile, and the parameters after the steps, fp32, flat."""
    import cProfile
    import pstats

    import deepspeed
    import torch

    module = bodies.build(model, 60)
    engine = bodies._engine(module, stage, switched)
    x = bodies.example_input(module)
    calls = []
    for step in range(steps):
        profile = cProfile.Profile()
        with bodies.switched_off(engine) if switched and step % 2 else contextlib.nullcontext():
            profile.enable()
            bodies._step(engine, x)
            profile.disable()
        calls.append(sum(v[1] for k, v in pstats.Stats(profile).stats.items() if bodies._ours(k[0]) is not None))
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return calls, torch.cat([p.detach().float().flatten() for p in params])


@pytest.mark.parametrize("stage, model", [(2, "moe"), (3, "moe"), (3, "moe_rank_dependent")])
def test_switched_off_steps_are_stock_steps_on_the_same_engine(ranks, stage, model):
    """``bodies.switched_off``, which the same-engine timing rests on: in a step inside it no safe_zero function runs,
    after it safe_zero runs again, and a safe_zero engine switched off in every other step trains bit-identical to a
    stock engine, on the models the bench times so, which stock trains right (ZeRO-3's leaf-module hook reduces the
    experts a rank did not run)."""
    if stage == 2 and flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")
    import torch

    switched = ranks.run(2, _switched_training, stage=stage, model=model, switched=True)
    stock = ranks.run(2, _switched_training, stage=stage, model=model, switched=False)
    for rank in range(2):
        calls, params = switched[rank]
        assert calls[1] == calls[3] == 0
        assert calls[0] > calls[2] > 0  # the first step agrees; each later on-step walks the agreed order
        assert stock[rank][0] == [0, 0, 0, 0]
        assert torch.equal(params, stock[rank][1])
    timed = ranks.run(2, bodies.switched_seconds, stage=stage, rounds=3, warmup=1, model=model, tensors=60)
    assert all(len(rounds) == 3 and all(len(steps) == 3 and min(steps) > 0 for steps in rounds) for rounds in timed)


def test_gap_interval_brackets_a_known_gap_and_narrows_with_more_runs():
    """The 95 % interval of ratio - floor, by resampling whole runs: it holds the gap the rounds were drawn with, more
    runs narrow it, and a run whose buffers landed badly (all its rounds shifted) widens it."""
    import random

    from benchmarks import run

    draw = random.Random(1)
    widths = []
    for runs in (8, 128):
        floors = [draw.gauss(1.0, 0.05) for _ in range(10 * runs)]
        ratios = [draw.gauss(1.02, 0.05) for _ in range(10 * runs)]
        low, high = run._gap_interval(ratios, floors, runs)
        assert low < 0.02 < high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2
    floors = [draw.gauss(1.0, 0.01) for _ in range(40)]
    ratios = [draw.gauss(1.0, 0.01) for _ in range(40)]
    shifted = ratios[:30] + [r + 0.1 for r in ratios[30:]]
    calm, skewed = run._gap_interval(ratios, floors, 4), run._gap_interval(shifted, floors, 4)
    assert skewed[1] - skewed[0] > 2 * (calm[1] - calm[0])
    assert run._gap_interval([1.0] * 6, [1.0] * 6, 3) == [0.0, 0.0]


def test_a_timed_row_without_a_profile_renders():
    """A ratio-only row measured for the first time (no calls, collectives or state) still renders, as not profiled."""
    from benchmarks import run

    row = {"model": "moe", "size": 200, "stage": 3, **bodies.describe("moe", 200), "median_ratio": 1.004,
           "stock_vs_stock_ratio": 1.0, "gap_ci95": [-0.01, 0.02], "rounds": 6, "stock_ms": 5.0, "safe_ms": 5.02}
    text = "\n".join(run.scaled_lines({"scaled": {"moe/200/zero3": row}, "scaled_machine": "test"}))
    assert "| `moe` | 189 | ZeRO-3 | 5 ms | 5 ms | 1.004 (median of 6 rounds) | 1.000 | within (+0.004, 95 % interval " \
           "-0.010 to +0.020) | not profiled | | |" in text


def test_a_switched_timing_renders_its_share():
    """The same-engine timing renders as its own table: ratio on/off against the off/off floor, and the share of the
    step it puts on safe_zero, (ratio - floor) / ratio, with the interval scaled alike."""
    from benchmarks import run

    switched = {"median_ratio": 1.009, "stock_vs_stock_ratio": 1.0, "gap_ci95": [0.0, 0.0202], "rounds": 24,
                "runs": 4, "stock_ms": 100.0, "safe_ms": 100.9, "load": 1.0}
    row = {"model": "moe", "size": 200, "stage": 2, **bodies.describe("moe", 200), "switched": switched}
    text = "\n".join(run.scaled_lines({"scaled": {"moe/200/zero2": row}, "scaled_machine": "test"}))
    assert "| `moe` | 189 | ZeRO-2 | 100 ms | 101 ms | 1.009 (median of 24 rounds in 4 runs, load 1) | 1.000 | within " \
           "(+0.009, 95 % interval +0.000 to +0.020) | 0.89 % (95 % interval 0.00 to 2.00 %) |" in text


def _sampled_or_skip(result: dict) -> dict:
    """``result`` of a sampling; skipped where this machine forbids reading another process (ptrace), failed where
    py-spy is missing (the bench extra installs it)."""
    error = result.get("error", "")
    if "Permission denied" in error or "Operation not permitted" in error:
        pytest.skip(f"py-spy may not read processes here: {error}")
    assert not error
    return result


def _half_in_safe_zero(seconds: float) -> None:
    """About half of ``seconds`` in a safe_zero function (the planner's order merge: Python, and the C functions it
    calls), half in this file's, in turns of 5 ms."""
    import operator
    import time

    from safe_zero.fixes.gradless.planner import merge_orders

    arrivals = [list(range(500))] * 2
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        turn = time.perf_counter() + 0.005
        while time.perf_counter() < turn:
            merge_orders(arrivals, 500, key=operator.neg)
        turn = time.perf_counter() + 0.005
        while time.perf_counter() < turn:
            sum(i * i for i in range(500))


def test_sampling_charges_safe_zero_the_samples_in_its_own_frames():
    """``bodies.sampling`` with py-spy, and ``attributed``: a call that spends half its time in a safe_zero function
    gets about half its samples charged to safe_zero, in that function."""
    with bodies.sampling(rate=400) as got:
        if "error" not in got:
            _half_in_safe_zero(2.0)
    counts = bodies.attributed(_sampled_or_skip(got)["raw"], _half_in_safe_zero.__code__)
    assert counts["samples"] > 200
    assert 0.3 < counts["ours"] / counts["samples"] < 0.7
    assert set(counts["functions"]) <= {"fixes/gradless/planner.py:merge_orders",
                                        "fixes/gradless/planner.py:<listcomp>"}
    assert counts["functions"]["fixes/gradless/planner.py:merge_orders"] > 0


def test_attributed_counts_the_marked_call_and_safe_zero_innermost_frames():
    """Only samples taken inside the marked call count, and a sample is safe_zero's by its innermost frame alone: a
    DeepSpeed method that safe_zero called is DeepSpeed's."""
    import os

    import safe_zero

    ours = os.path.join(os.path.dirname(safe_zero.__file__), "fixes", "gradless", "stage12.py")
    marked = bodies._sampled_steps.__code__
    outer = f"<module> (run.py:1);_sampled_steps ({marked.co_filename}:{marked.co_firstlineno + 3})"
    raw = [f"<module> (run.py:1);ReduceInOneOrderStage12.process_gradients ({ours}:60) 7",  # outside the call
           f"{outer};ReduceInOneOrderStage12.process_gradients ({ours}:64) 5",
           f"{outer};ReduceInOneOrderStage12.process_gradients ({ours}:66);"
           "DeepSpeedZeroOptimizer.process_gradients (/ds/stage_1_and_2.py:9) 11",
           f"{outer};backward (/torch/autograd/__init__.py:395) 80"]
    counts = bodies.attributed(raw, marked)
    assert counts == {"samples": 96, "ours": 5, "functions": {"fixes/gradless/stage12.py:process_gradients": 5}}


def test_sampled_share_charges_nothing_to_safe_zero_switched_off(ranks):
    """``bodies.sampled_share`` in 2 ranks: the steps are sampled on each rank, and with safe_zero switched off (a
    stock step) no sample is safe_zero's."""
    for off in (True, False):
        for result in ranks.run(2, bodies.sampled_share, stage=2, model="moe", tensors=60, steps=20, off=off):
            result = _sampled_or_skip(result)
            assert result["samples"] > 20 and result["steps"] == 20
            if off:
                assert result["ours"] == 0 and result["functions"] == {}


def test_a_sampled_share_renders_pooled_over_ranks_with_its_interval():
    """The ranks' samples are summed, the share gets Wilson's 95 % interval, and the table names where they fell; a
    row py-spy could not sample says why."""
    from benchmarks import run

    per_rank = [{"samples": 9000, "ours": 60, "functions": {"a.py:f": 50, "b.py:g": 10}, "steps": 200, "rate": 400},
                {"samples": 11000, "ours": 100, "functions": {"a.py:f": 70, "c.py:h": 30}, "steps": 200, "rate": 400}]
    pooled = run.pooled_samples(per_rank)
    assert pooled["samples"] == 20000 and pooled["ours"] == 160 and pooled["share"] == 0.008
    assert pooled["functions"] == {"a.py:f": 120, "c.py:h": 30, "b.py:g": 10}
    low, high = pooled["ci95"]
    assert 0.0068 < low < 0.008 < high < 0.0094
    wide = run.wilson(16, 2000)
    assert wide[0] < low and wide[1] > high
    assert run.pooled_samples([per_rank[0], {"error": "py-spy did not sample this process: denied"}]) == {
        "error": "py-spy did not sample this process: denied"}
    described = bodies.describe("moe", 200)
    rows = {"moe/200/zero2": {"model": "moe", "size": 200, "stage": 2, **described, "sampled": pooled},
            "moe/200/zero3": {"model": "moe", "size": 200, "stage": 3, **described,
                              "sampled": {"error": "py-spy is not installed"}}}
    text = "\n".join(run.scaled_lines({"scaled": rows, "scaled_machine": "test"}))
    assert f"| `moe` | 189 | ZeRO-2 | 200 (400) | 20000 | 160 | 0.80 % ({100 * low:.2f} to {100 * high:.2f} %) | " \
           "`a.py:f` 120, `c.py:h` 30, `b.py:g` 10 |" in text
    assert "| `moe` | 189 | ZeRO-3 | not sampled: py-spy is not installed | | | | |" in text


def test_a_results_file_with_scaled_rows_only_renders(tmp_path):
    """``run.py --only scaled --results NEW.json`` on a file no full run wrote: RESULTS.md has the scaled tables, and
    no control table it has no rows for."""
    from benchmarks import run

    row = {"model": "moe", "size": 200, "stage": 2, **bodies.describe("moe", 200),
           "sampled": {"samples": 1000, "ours": 10, "share": 0.01, "ci95": [0.005, 0.018], "steps": 40, "rate": 400,
                       "functions": {"fixes/gradless/stage12.py:process_gradients": 10}}}
    path = tmp_path / "RESULTS.md"
    run.render({"scaled": {"moe/200/zero2": row}, "scaled_machine": "test"}, str(path))
    text = path.read_text()
    assert "| `moe` | 189 | ZeRO-2 | 40 (400) | 1000 | 10 | 1.00 % (0.50 to 1.80 %) |" in text
    assert "control model" not in text
