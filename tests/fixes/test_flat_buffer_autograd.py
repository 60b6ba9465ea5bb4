"""ZeRO-1/2 at world size 2 on gloo: DeepSpeed 0.18.7+ builds its flat parameter
buffers with autograd history and every step's all-gather raises; safe_zero detaches them.

Both a control model and an FP-Quant-like model with zero-element placeholders (which also
needs ``zero_element_groups``) are checked. On 0.19.x stock already works and the fix is off.
"""

import pytest
from packaging.version import Version

from rig import RankFailure
from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.fixes import flat_buffer_autograd, zero_element_groups
from tests.support.bodies import FRAGMENT_ASSERT, check_trained_and_restored, train_and_roundtrip

NEEDED = flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION)

SPLIT_VIEW = "Output 0 of Split is a view and is being modified inplace"
FRAGMENT = r"fragment start (\d+) should be < fragment_end \1"


def test_fix_is_needed_exactly_where_the_buffer_has_history():
    # 0.18.7 started flattening from the live parameters; 0.19.0 detaches the result.
    versions = ["0.18.6", "0.18.7", "0.18.9", "0.19.0", "0.19.8"]
    assert [flat_buffer_autograd.FIX.needed(Version(v)) for v in versions] == [False, True, True, False, False]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("model", ["Control", "FPQuantLike"])
def test_stock_zero12_at_world_size_2(ranks, tmp_path, model, stage):
    run = dict(model=model, stage=stage, safe=False, world_size=2, ckpt_dir=str(tmp_path))
    if model == "FPQuantLike" and FRAGMENT_ASSERT:
        # Each rank's partition holds a placeholder, so both fail at initialize, before any all-gather.
        with pytest.raises(RankFailure, match=FRAGMENT) as failure:
            ranks.run(2, train_and_roundtrip, **run)
        assert len(failure.value.errors) == 2
    elif NEEDED:
        with pytest.raises(RankFailure, match=SPLIT_VIEW) as failure:
            ranks.run(2, train_and_roundtrip, **run)
        assert len(failure.value.errors) == 2
        assert "all_gather_into_tensor" in failure.value.errors[0].traceback
    else:
        check_trained_and_restored(ranks.run(2, train_and_roundtrip, **run))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("model", ["Control", "FPQuantLike"])
def test_safe_zero12_trains_and_restores_at_world_size_2(ranks, tmp_path, model, stage):
    results = ranks.run(2, train_and_roundtrip, model=model, stage=stage, safe=True, world_size=2,
                        ckpt_dir=str(tmp_path))
    check_trained_and_restored(results)
    for r in results:
        assert r["wrapper"] == "SafeDeepSpeedZeroOptimizer"
        assert r["flat_buffer_history"] == [False], \
            "the flat buffer the all-gather writes must carry no autograd history"
        assert ("flat_buffer_autograd" in r["report"]) == NEEDED
        assert ("zero_element_groups" in r["report"]) == (
            model == "FPQuantLike" and zero_element_groups.FIX.needed(DEEPSPEED_VERSION))
    if model == "FPQuantLike":
        assert results[0]["shapes_after"] == {"q1.weight": (0,), "q2.weight": (0,)}
    if not NEEDED and not zero_element_groups.FIX.needed(DEEPSPEED_VERSION):
        assert all(r["report"] == {} for r in results), "no fix may act where DeepSpeed has no defect"
