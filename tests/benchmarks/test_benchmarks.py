"""The timing harness ``make bench`` runs (``benchmarks/run.py``), at sizes a test can afford, and its baselines.

Times are not asserted here (timed tests are noise): the harness returns one step per engine per round, its
statistics bracket a known gap, a run writes its section on top of RESULTS.md, and the rank-dependent model's
baselines train what safe_zero trains. The deterministic costs are asserted in ``test_costs.py``.
"""

import importlib.util
import os
import random
import subprocess

import pytest

from benchmarks import bodies, run
from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import flat_buffer_autograd

# `make bench` runs on the main leg's DeepSpeed only.
pytestmark = pytest.mark.main_leg_only
#: The intervals need scipy (the bench extra), which the floor leg does not install.
needs_scipy = pytest.mark.skipif(importlib.util.find_spec("scipy") is None, reason="scipy: pip install '.[bench]'")


def test_stepped_seconds_times_every_engine_each_round(ranks):
    engines = (False, False, True, {"find_unused_parameters": False})
    per_rank = ranks.run(2, bodies.stepped_seconds, stage=3, rounds=3, warmup=1, engines=engines, built_first=2)
    assert len(per_rank) == 2
    for rounds in per_rank:
        assert len(rounds) == 3
        assert all(len(steps) == len(engines) and min(steps) > 0 for steps in rounds)


@needs_scipy
def test_make_bench_writes_a_section_on_top_of_results_md(tmp_path, monkeypatch):
    """``run.main`` at its smallest (the control model at ZeRO-2, one round a run): a section with the row, its
    no-agreement line and the import time goes on top, the raw rounds to the raw file, and the oldest section past
    ``KEEP`` is dropped."""
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")
    results = tmp_path / "RESULTS.md"
    results.write_text(run.HEADER + "".join(f"\n## run {i}\n\n| a table |\n" for i in range(run.KEEP)))
    monkeypatch.setattr(run, "RAW_JSON", str(tmp_path / "raw.json"))
    monkeypatch.setattr(run, "import_ms", lambda: 45.0)
    assert run.main(["--rows", "control", "--stages", "2", "--rounds", "1", "--builds", "1",
                     "--results", str(results)]) == 0
    text = results.read_text()
    assert text.startswith(run.HEADER)
    sections = text.split("\n## ")[1:]
    assert len(sections) == run.KEEP and sections[1].startswith("run 0") and "run 9" not in text
    new = sections[0]
    assert "DeepSpeed 0.19" in new.splitlines()[0] and "CPUs" in new.splitlines()[0]
    assert "| `control` | 8 | ZeRO-2 | " in new and " | 4 (4) |" in new  # one round in each of 4 runs
    assert '| *`"find_unused_parameters": false` (no rank agreement) against stock* | | ' in new
    assert "`import safe_zero` after `import deepspeed`: 45 ms" in new
    assert (tmp_path / "raw.json").exists()


def test_make_bench_writes_its_reports_where_git_ignores_them():
    """A run's report is an output: neither its Markdown section nor its raw rounds land in a tracked path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=root, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    for path in (run.RESULTS_MD, run.RAW_JSON):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=root).returncode == 0, path


def _runs(draw: random.Random, runs: int, gap: float, shift: float = 0.0, rounds: int = 10) -> list:
    """Made-up rounds: per run, engines stock, stock again, safe_zero (``gap`` slower); the last quarter of the runs
    ``shift`` slower for safe_zero (buffers that landed badly)."""
    out = []
    for r in range(runs):
        stock = [draw.gauss(1.0, 0.05) for _ in range(rounds)]
        late = shift if r >= 3 * runs // 4 else 0.0
        out.append([stock, [s * draw.gauss(1.0, 0.05) for s in stock],
                    [s * (draw.gauss(1.0 + gap, 0.05) + late) for s in stock]])
    return out


@needs_scipy
def test_the_interval_of_ratio_minus_floor_brackets_a_known_gap_and_narrows_with_more_runs():
    """``run.gap``: the 95 % interval of ratio - floor (scipy's bootstrap over whole runs) holds the gap the rounds
    were drawn with, more runs narrow it, and runs whose buffers landed badly (all their rounds shifted) widen it."""
    draw = random.Random(1)
    widths = []
    for runs in (8, 128):
        g = run.gap(_runs(draw, runs, 0.02), 2, 0)
        low, high = g["interval"]
        assert low < 0.02 < high and low < g["ratio"] - g["floor"] < high
        assert g["rounds"] == 10 * runs and g["runs"] == runs
        widths.append(high - low)
    assert widths[1] < widths[0] / 2
    calm, skewed = run.gap(_runs(draw, 8, 0.0), 2, 0)["interval"], run.gap(_runs(draw, 8, 0.0, 0.1), 2, 0)["interval"]
    assert skewed[1] - skewed[0] > 2 * (calm[1] - calm[0])
    assert run.gap(_runs(draw, 2, 0.0), 2, 0)["interval"] is None  # too few runs to resample


@needs_scipy
def test_a_row_renders_its_line_and_each_extra_engines():
    """The rank-dependent MoE at ZeRO-2 also times stock touching the experts each rank skips: its line is safe_zero
    over that engine (engine 3), with the same floor."""
    runs = [[[0.10] * 4, [0.10] * 4, [0.12] * 4, [0.15] * 4]] * 3
    row = {"model": "moe_rank_dependent", "tensors": 999, "stage": 2, "runs": runs,
           "extras": [["safe_zero against stock touching the experts each rank skips", True]]}
    assert run.lines(row) == [
        "| `moe_rank_dependent` | 999 | ZeRO-2 | 100.0 ms | 120.0 ms | 1.200 | 1.000 | +0.200 (+0.200 to +0.200) | "
        "12 (3) |",
        "| *safe_zero against stock touching the experts each rank skips* | | | 150.0 ms | 120.0 ms | 0.800 | 1.000 | "
        "-0.200 (-0.200 to -0.200) | 12 (3) |"]
    assert list(run.extra_engines("moe_rank_dependent", 2).values()) == [(bodies.TOUCHED, True)]
    assert run.extra_engines("moe_rank_dependent", 3) == {} and run.extra_engines("moe", 2) == {}


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
