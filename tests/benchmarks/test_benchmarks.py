"""The benchmark code keeps working: the bodies ``make bench`` runs, at sizes a test can afford.

Numbers are not asserted here (timed tests are noise); properties are: the paired timing returns
one pair per step, the all-gather count with all-zero-sized submodules equals the count without,
and safe_zero's flat order puts every grouped_mm weight on the grid with no padding.
"""

import pytest

from benchmarks import bodies
from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import flat_buffer_autograd


@pytest.mark.parametrize("stage", [2, 3])
def test_paired_step_seconds_times_both_engines_per_step(ranks, stage):
    if stage == 2 and flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")
    per_rank = ranks.run(2, bodies.paired_step_seconds, stage=stage, pairs=3, warmup=1, b_built_first=True)
    assert len(per_rank) == 2
    for pairs in per_rank:
        assert len(pairs) == 3
        assert all(stock > 0 and safe > 0 for stock, safe in pairs)


def test_all_gathers_per_step_equal_with_and_without_empty_submodules(ranks):
    without = ranks.run(2, bodies.all_gathers_per_step, k=0)
    with_empty = ranks.run(2, bodies.all_gathers_per_step, k=4)
    assert without == with_empty
    assert all(count > 0 for per_step in without for count in per_step)


def test_safe_zero_order_aligns_gpt_oss_with_sinks_without_padding():
    pytest.importorskip("transformers")
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
    and the broadcast of rank 0's reduction order (ZeRO-3: with each parameter's module clock); after it nothing.
    In the first ZeRO-3 step also the module-order agreement, one all-gather per module."""
    if stage == 2 and flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):
        pytest.skip("stock ZeRO-2 cannot step at 2 gloo ranks on this DeepSpeed (flat_buffer_autograd): no baseline")
    stock = ranks.run(2, bodies.collectives_per_step, stage=stage, safe=False)[0]
    safe = ranks.run(2, bodies.collectives_per_step, stage=stage, safe=True)[0]
    assert len(stock) == len(safe) == 3
    for step, (before, after) in enumerate(zip(stock, safe)):
        extra = {name: after.get(name, 0) - before.get(name, 0) for name in set(before) | set(after)}
        expected = {"all_reduce": 1, "all_reduce_bytes": 8, "broadcast": 1} if step == 0 else {}
        if stage == 3 and step == 0:  # DeepSpeed records its trace: the ranks agree on each of Wide's 4 modules
            expected["all_gather"] = 4
        assert {name: n for name, n in extra.items() if n} == expected, (step, before, after)
