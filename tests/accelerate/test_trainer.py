"""HF Trainer on a tiny FP-Quant-style Llama at ZeRO-3, with 1 and 2 processes; and at ZeRO-2 on 2 ranks with
different batches, an MoE whose ranks use different experts against single-process training on the global batch.

The Llama (hidden 64, 2 layers, vocab 128, from a LlamaConfig) has FP-Quant's zero-sized ``(0,)``
placeholders and a trainable ``dqweight`` that never gets a gradient. Stock DeepSpeed fails; the
``SafeZeroCallback`` route and the config-file route (the JSON's "safe_zero" block plus ``import
safe_zero.accelerate``) train it with a finite, falling loss.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.accelerate.launch import accelerate_launch, by_phase  # noqa: E402
from tests.support.bodies import HOOK_RUNS_WITHOUT_A_GRADIENT  # noqa: E402
from tests.support.models import build  # noqa: E402
from tests.support.rank_dependent import (LR, MODELS, STEPS,  # noqa: E402
                                          assert_trained_on_its_batches_as_the_reference, dealt_rows,
                                          rank_dependent_config)

SCRIPT = "tests/accelerate/trainer_script.py"

# Which ZeRO-3 defect the tiny Llama hits first: the grad-less dqweight in backward, or a
# zero-sized placeholder in an all-gather.
STOCK_ERRORS = ("'NoneType' object has no attribute 'numel'", "'status': 'NOT_AVAILABLE', 'numel': 0")
ENGAGED = {"zero3_zero_element_params"} | ({"gradless_params"} if HOOK_RUNS_WITHOUT_A_GRADIENT else set())


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
        # gradless_params acts in dqweight's gradient hook, which torch 2.4-2.6 never calls at one process.
        assert ENGAGED <= set(r["engaged"]), r["engaged"]
    assert all(r["losses"] == records[0]["losses"] for r in records)


@pytest.mark.slow
def test_trainer_one_process_stock_fails_config_route_trains():
    records, _ = accelerate_launch("--config_file", "examples/accelerate/zero3.yaml", "--num_processes", "1",
                                   SCRIPT, "stock-then-import")
    (stock,) = by_phase(records, "stock", 1)
    if HOOK_RUNS_WITHOUT_A_GRADIENT:
        assert any(e in stock["error"] for e in STOCK_ERRORS), stock
    else:  # no hook for dqweight's None gradient, and one process gathers no placeholder: stock trains
        assert stock["error"] is None, stock
    check_trained(by_phase(records, "safe", 1), world=1)


@pytest.mark.slow
def test_trainer_two_processes_with_safe_zero_callback():
    records, output = accelerate_launch("--config_file", "examples/accelerate/zero3.yaml", SCRIPT, "callback")
    # Without the CPU process-state line, the callback stops before training and says what to pass -- where
    # Accelerate counts one process on a CPU host (1.9 counts the launcher's two: there is nothing to stop).
    trained_without = 0
    for r in by_phase(records, "no-cpu-state", 2):
        if r["error"] is None:
            assert r["world"] == 2 and r["safe"], r
            trained_without = 1
            continue
        assert r["error"].startswith("WorldSizeMismatchError: Accelerate counts 1 process(es) but the DeepSpeed "
                                     "process group has 2"), r
        assert "use_cpu=True" in r["error"], "transformers 5.x's own way first"
        assert "cpu_distributed_state()" in r["error"] and "use_configured_state" in r["error"]
    check_trained(by_phase(records, "safe", 2), world=2)
    # The callback's line on the main process says which fixes acted.
    assert output.count("safe_zero: Trainer's DeepSpeed engine built by safe_zero") == 1 + trained_without, \
        output[-4000:]


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


class _RankDependentDataset(torch.utils.data.Dataset):
    """``dealt_rows`` as the ``{"x", "y"}`` rows Trainer's default collator stacks."""

    def __init__(self, world_size: int) -> None:
        self.rows = dealt_rows("moe", world_size)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        x, y = self.rows[i]
        return {"x": x, "y": y}


def _trainer_trains_rank_dependent_experts(output_dir: str) -> dict:
    """HF Trainer with ``SafeZeroCallback`` on the rank pool's ranks (what ``accelerate launch`` starts): ZeRO-2 fp32,
    Trainer's own AdamW at a constant ``LR``, clipping at 1.0, each rank on its own batches."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from safe_zero.accelerate import SafeZeroCallback, cpu_distributed_state, uninstall_on_request

    class MoE(MODELS["moe"]):
        """The MoE with Trainer's output (a dict with the loss); records the inputs each step saw."""

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
            self.seen.append(x.detach().clone())
            return {"loss": super().forward(x, y)}

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):  # no shuffling: dealt_rows' layout decides who gets what
            return torch.utils.data.SequentialSampler(self.train_dataset)

    world = dist.get_world_size()
    ds = rank_dependent_config(world)
    # fp16 off in so many words: Transformers 4.50 (the floor) reads a config without it as DeepSpeed's old fp16
    # default.
    ds.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
              gradient_clipping="auto", fp16={"enabled": False})
    environ = dict(os.environ)
    try:
        args = TrainingArguments(output_dir=output_dir, deepspeed=ds, per_device_train_batch_size=2, max_steps=STEPS,
                                 learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
                                 optim="adamw_torch", logging_steps=1, save_strategy="no", report_to=[],
                                 disable_tqdm=True,
                                 accelerator_config={"use_configured_state": cpu_distributed_state()})
        net = build(MoE)
        net.seen = []
        trainer = InOrder(model=net, args=args, train_dataset=_RankDependentDataset(world),
                          callbacks=[SafeZeroCallback()])
        trainer.train()
        engine = trainer.model_wrapped
        return {"rank": dist.get_rank(), "world": trainer.accelerator.num_processes, "seen": net.seen,
                "stage": engine.zero_optimization_stage(), "safe": hasattr(engine, "safe_zero_session"),
                "params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}}
    finally:  # leave the pool's process as it was for the next test
        AcceleratorState._reset_state(reset_partial_state=True)
        uninstall_on_request()
        os.environ.clear()
        os.environ.update(environ)


def test_trainer_trains_rank_dependent_experts_as_one_process_on_the_global_batch(ranks, tmp_path):
    for r in ranks.run(2, _trainer_trains_rank_dependent_experts, output_dir=str(tmp_path)):
        assert (r["world"], r["stage"], r["safe"]) == (2, 2, True)
        assert_trained_on_its_batches_as_the_reference(r, "moe", 2)  # one forward a step, each rank's own batches
