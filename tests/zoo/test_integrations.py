"""A vision-language model from the zoo through the integrations, ZeRO-3 with every parameter partitioned, no
``safe_zero`` configuration, on data whose image ranks change from step to step (``rows.PATTERNS``' "rotating": images
on every rank, then on rank 0 only, on none, on rank 1 only): the ``Accelerator`` of an ``accelerate launch`` and the
HF ``Trainer`` train it as one process trains on the global batch (``rows.reference``).

The rank pool's ranks are the processes a launcher would start (``LOCAL_RANK`` set, gloo).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.zoo.architectures import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, NO_ZOO, Architecture  # noqa: E402
from tests.zoo.rows import EPS, LR, TOLERANCE, _batches, ds_config, max_difference, reference, steps  # noqa: E402

pytestmark = pytest.mark.skipif(not MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, reason=NO_ZOO)

VLM = Architecture("qwen2_5_vl", "vlm")
PATTERN = "rotating"


def _client_optimizer_config(world_size: int) -> dict:
    """``rows.ds_config`` at ZeRO-3 with the optimizer left to the client (the reference's ``torch.optim.AdamW``)."""
    config = ds_config(3, world_size, persistence=0)
    del config["optimizer"]
    return {**config, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


def _full_params(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _accelerate_trains_a_vlm() -> dict:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from safe_zero.accelerate import SafeDeepSpeedPlugin
    from tests.zoo.architectures import build

    world = dist.get_world_size()
    # Built before the ZeRO-3 plugin exists: under it transformers would initialise the weights in
    # ``deepspeed.zero.Init``, partition by partition, and they would not be the reference's.
    net = build(VLM)
    batches = _batches(VLM, net, dist.get_rank(), PATTERN, world_size=world)
    try:
        accelerator = Accelerator(deepspeed_plugin=SafeDeepSpeedPlugin(hf_ds_config=_client_optimizer_config(world)))
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
        model, optimizer = accelerator.prepare(net, optimizer)
        losses = []
        for inputs in batches:
            loss = model(**inputs).loss
            accelerator.backward(loss)  # DeepSpeed's backward and step
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return {"safe": hasattr(model, "safe_zero_session"), "stage": model.zero_optimization_stage(),
                "losses": losses, "params": _full_params(model)}
    finally:  # leave the pool's process as it was for the next test
        AcceleratorState._reset_state(reset_partial_state=True)


class _DealtBatches(torch.utils.data.Dataset):
    """Every rank's batches, laid out so that Trainer's loader (no shuffling, one item a batch, whole batches dealt
    round-robin) hands each rank its own; an item is a ready batch."""

    def __init__(self, world_size: int) -> None:
        from tests.zoo.architectures import build

        net = build(VLM)
        per_rank = [_batches(VLM, net, rank, PATTERN, world_size=world_size) for rank in range(world_size)]
        self.items = [per_rank[rank][step] for step in range(steps(PATTERN)) for rank in range(world_size)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def _trainer_trains_a_vlm(output_dir: str) -> dict:
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from safe_zero.accelerate import SafeZeroCallback, cpu_distributed_state, uninstall_on_request
    from tests.zoo.architectures import build

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):  # no shuffling: _DealtBatches' layout decides who gets what
            return torch.utils.data.SequentialSampler(self.train_dataset)

    world = dist.get_world_size()
    ds = _client_optimizer_config(world)
    ds.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
              gradient_clipping="auto")
    environ = dict(os.environ)
    net, dealt = build(VLM), _DealtBatches(world)  # before TrainingArguments makes ZeRO-3 weights zero.Init's
    try:
        args = TrainingArguments(output_dir=output_dir, deepspeed=ds, per_device_train_batch_size=1,
                                 max_steps=steps(PATTERN),
                                 learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
                                 optim="adamw_torch", adam_epsilon=EPS, save_strategy="no", report_to=[],
                                 disable_tqdm=True,
                                 accelerator_config={"use_configured_state": cpu_distributed_state()})
        trainer = InOrder(model=net, args=args, train_dataset=dealt,
                          data_collator=lambda items: items[0], callbacks=[SafeZeroCallback()])
        # Each rank's loss is its own mean, as the reference's: not Trainer's token count over the ranks.
        trainer.model_accepts_loss_kwargs = False
        trainer.train()
        engine = trainer.model_wrapped
        return {"safe": hasattr(engine, "safe_zero_session"), "stage": engine.zero_optimization_stage(),
                "params": _full_params(engine)}
    finally:  # leave the pool's process as it was for the next test
        AcceleratorState._reset_state(reset_partial_state=True)
        uninstall_on_request()
        os.environ.clear()
        os.environ.update(environ)


def test_accelerate_trains_a_vlm_whose_image_ranks_change_at_zero3(ranks):
    expected = reference(VLM, 2, PATTERN)
    for r in ranks.run(2, _accelerate_trains_a_vlm, timeout=240):
        assert (r["safe"], r["stage"]) == (True, 3)
        assert max_difference(r["params"], expected["params"]) < TOLERANCE


def test_trainer_trains_a_vlm_whose_image_ranks_change_at_zero3(ranks, tmp_path):
    expected = reference(VLM, 2, PATTERN)
    for r in ranks.run(2, _trainer_trains_a_vlm, output_dir=str(tmp_path), timeout=240):
        assert (r["safe"], r["stage"]) == (True, 3)
        assert max_difference(r["params"], expected["params"]) < TOLERANCE
