"""HF Trainer: a checkpoint written by the stock Trainer resumes through safe_zero exactly (issue 16 item 5).

safe_zero turns DeepSpeed's ``parameter_alignment`` on for the grouped_mm weights, so the stock checkpoint's ZeRO-2
layout differs from the resumed run's; DeepSpeed's own conversion lays it out again (``LoadsUnpaddedCheckpoints``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.accelerate.launch import accelerate_launch, by_phase  # noqa: E402

SCRIPT = "tests/accelerate/resume_script.py"


@pytest.mark.slow
def test_trainer_resumes_a_stock_checkpoint_through_safe_zero(tmp_path):
    from safe_zero._compat import DEEPSPEED_VERSION, PARAMETER_ALIGNMENT_OPTION

    if DEEPSPEED_VERSION not in PARAMETER_ALIGNMENT_OPTION:
        pytest.skip(f"the stock -> safe_zero ZeRO-2 conversion needs DeepSpeed {PARAMETER_ALIGNMENT_OPTION}")
    launch = ("--config_file", "examples/accelerate/zero2.yaml", "--num_processes", "1", SCRIPT)
    records, _ = accelerate_launch(*launch, "stock", str(tmp_path))
    (stock,) = by_phase(records, "stock", 1)
    records, _ = accelerate_launch(*launch, "safe", str(tmp_path))
    (safe,) = by_phase(records, "safe", 1)
    assert not stock["safe"] and safe["safe"]
    # Steps 3 and 4 after resuming at step 2 equal the uninterrupted stock run's (step 4 reads Adam's state).
    assert stock["steps_run"] == 4 and safe["steps_run"] == 2, "the safe_zero run must resume, not start over"
    assert [safe["losses"][s] for s in ("3", "4")] == [stock["losses"][s] for s in ("3", "4")], (stock, safe)
