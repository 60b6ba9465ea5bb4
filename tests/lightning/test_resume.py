"""Lightning resumes a checkpoint stock DeepSpeed wrote through Lightning, through safe_zero, exactly (issue 16 item 5).

Stock Lightning's DeepSpeedStrategy does not run on CPU; the safe strategy's CPU path with DeepSpeed's own
``initialize`` (``cases.stock_deepspeed``) is what it runs on a GPU, so its ``trainer.save_checkpoint`` writes the
checkpoint stock Lightning writes. The model is the tiny GPT-OSS whose grouped_mm expert weights stock ZeRO-2 puts
off the 16-byte grid: safe_zero turns on DeepSpeed's ``parameter_alignment`` there, so the stock checkpoint's flat
layout differs from the resumed run's and loads only through ``LoadsUnpaddedCheckpoints``. ZeRO-3 at two ranks
keeps stock's layout. The two Trainers per run share the rank pool's process group (``devices=2`` at world size 2).
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from tests.lightning import cases  # noqa: E402
from tests.support.models import skip_without_grouped_mm_transformers  # noqa: E402

WORLD_SIZE = 2
ENGINES = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_resumes_a_stock_checkpoint_through_safe_zero(ranks, tmp_path, stage):
    from safe_zero._compat import DEEPSPEED_VERSION, PARAMETER_ALIGNMENT_OPTION

    skip_without_grouped_mm_transformers()
    if stage == 2 and DEEPSPEED_VERSION not in PARAMETER_ALIGNMENT_OPTION:
        pytest.skip(f"the stock -> safe_zero ZeRO-2 conversion needs DeepSpeed {PARAMETER_ALIGNMENT_OPTION}")
    results = ranks.run(WORLD_SIZE, cases.trainer_resumes_stock_checkpoint, stage=stage, devices=WORLD_SIZE,
                        tmp=str(tmp_path), timeout=600)
    half = cases.RESUME_STEPS // 2
    for r in results:
        # The stock runs ran stock DeepSpeed; the resumed one ran safe_zero, whose fix acted.
        assert r["stock_engine"] == [ENGINES[stage], False], r["stock_engine"]
        assert r["resumed_engine"] == ["Safe" + ENGINES[stage], True], r["resumed_engine"]
        assert len(r["stock_losses"]) == cases.RESUME_STEPS and r["saved_losses"] == r["stock_losses"][:half]
        # Resumed at step 2, not started over: exactly the remaining steps ran, and they equal the uninterrupted
        # stock run's (the second reads Adam's restored moments), as do every weight, fp32 master and Adam moment.
        assert r["resumed_steps"] == cases.RESUME_STEPS and len(r["resumed_losses"]) == half
        assert r["resumed_losses"] == r["stock_losses"][half:], (r["resumed_losses"], r["stock_losses"])
        assert r["compared"] > 0 and r["unequal"] == [], r["unequal"]
        assert r["resumed_seen"] and set(r["resumed_seen"]) == {0}, r["resumed_seen"]
        if stage == 2:
            # Red on stock: the grouped_mm weights were off the grid, so safe_zero padded (a different layout)...
            assert set(r["stock_seen"]) - {0}, r["stock_seen"]
            assert any("parameter_alignment" in event for event in r["report"]["grouped_mm_alignment"]), r["report"]
            # ... and without LoadsUnpaddedCheckpoints DeepSpeed refuses the stock checkpoint.
            assert "parameter-alignment layout does not match" in r["unfixed_error"], r.get("unfixed_error")
        else:
            # ZeRO-3 at two ranks: stock's layout is aligned and kept, so the checkpoint is stock's; safe_zero's
            # session still acted (it pads the all-reduce fetch slots of the grouped_mm weights).
            assert set(r["stock_seen"]) == {0}, r["stock_seen"]
            assert "grouped_mm_alignment" in r["report"], r["report"]
    assert results[0]["resumed_losses"] == results[1]["resumed_losses"]
