"""HF Trainer on a tiny FP-Quant-style Llama at ZeRO-3, with 1 and 2 processes.

The Llama (hidden 64, 2 layers, vocab 128, from a LlamaConfig) has FP-Quant's zero-sized ``(0,)``
placeholders and a trainable ``dqweight`` that never gets a gradient. Stock DeepSpeed fails; the
``SafeZeroCallback`` route and the config-file route (the JSON's "safe_zero" block plus ``import
safe_zero.accelerate``) train it with a finite, falling loss.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.accelerate.launch import accelerate_launch, by_phase  # noqa: E402

SCRIPT = "tests/accelerate/trainer_script.py"

# Which ZeRO-3 defect the tiny Llama hits first: the grad-less dqweight in backward, or a
# zero-sized placeholder in an all-gather.
STOCK_ERRORS = ("'NoneType' object has no attribute 'numel'", "'status': 'NOT_AVAILABLE', 'numel': 0")


def check_trained(records: list[dict], world: int) -> None:
    for r in records:
        assert r["error"] is None, r
        assert r["safe"], "the Trainer's engine must be safe_zero's"
        assert (r["stage"], r["world"]) == (3, world)
        losses = r["losses"]
        assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
        assert losses[-1] < losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses
        assert r["placeholder_shapes"] == [[0], [0]], "FP-Quant's placeholders keep their (0,) shape"
        assert r["dq_unchanged"], "dqweight never gets a gradient and must keep its value"
        assert {"gradless_params", "zero3_zero_element_params"} <= set(r["engaged"]), r["engaged"]
    assert all(r["losses"] == records[0]["losses"] for r in records)


@pytest.mark.slow
def test_trainer_one_process_stock_fails_config_route_trains():
    records, _ = accelerate_launch("--config_file", "examples/accelerate/zero3.yaml", "--num_processes", "1",
                                   SCRIPT, "stock-then-import")
    (stock,) = by_phase(records, "stock", 1)
    assert any(e in stock["error"] for e in STOCK_ERRORS), stock
    check_trained(by_phase(records, "safe", 1), world=1)


@pytest.mark.slow
def test_trainer_two_processes_with_safe_zero_callback():
    records, output = accelerate_launch("--config_file", "examples/accelerate/zero3.yaml", SCRIPT, "callback")
    # Without the CPU process-state line, the callback stops before training and says what to pass.
    for r in by_phase(records, "no-cpu-state", 2):
        assert r["error"].startswith("WorldSizeMismatchError: Accelerate counts 1 process(es) but the DeepSpeed "
                                     "process group has 2"), r
        assert "use_cpu=True" in r["error"], "transformers 5.x's own way first"
        assert "cpu_distributed_state()" in r["error"] and "use_configured_state" in r["error"]
    check_trained(by_phase(records, "safe", 2), world=2)
    # The callback's line on the main process says which fixes acted.
    assert output.count("safe_zero: Trainer's DeepSpeed engine built by safe_zero") == 1, output[-4000:]


def test_callback_refuses_a_trainer_without_deepspeed():
    from accelerate.state import AcceleratorState

    from safe_zero import SafeZeroError
    from safe_zero.accelerate import SafeZeroCallback

    assert not AcceleratorState._shared_state, "this test expects no Accelerate state in the pytest process"
    with pytest.raises(SafeZeroError, match="SafeZeroCallback needs a DeepSpeed run"):
        SafeZeroCallback().on_init_end(None, None, None)


def test_callback_added_after_construction_refuses_to_train():
    from safe_zero import SafeZeroError
    from safe_zero.accelerate import SafeZeroCallback

    with pytest.raises(SafeZeroError, match=r"Pass it to the constructor: Trainer\(..., callbacks=\[SafeZeroCallback"):
        SafeZeroCallback().on_train_begin(None, SimpleNamespace(is_world_process_zero=True), None)
