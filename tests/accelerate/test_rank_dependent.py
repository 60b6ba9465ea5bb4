"""Accelerate at world size 2 with each rank on its own batches: an MoE whose ranks use different experts trains as
one process trains on the global batch (``tests/support/rank_dependent.py``'s reference).

The ranks of the rank pool are the processes an ``accelerate launch`` would start (``LOCAL_RANK`` set, gloo): the
``Accelerator`` gets a ``SafeDeepSpeedPlugin``, prepares the model, a client AdamW and a loader over
``dealt_rows``, and its sharded loader hands rank 0 tokens for experts 0-1 and rank 1 tokens for experts 2-3.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")

from tests.support.models import build  # noqa: E402
from tests.support.rank_dependent import (LR, MODELS, STEPS,  # noqa: E402
                                          assert_trained_on_its_batches_as_the_reference, dealt_rows,
                                          rank_dependent_config)


def _accelerate_trains_rank_dependent_experts() -> dict:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from safe_zero.accelerate import SafeDeepSpeedPlugin, uninstall_on_request

    world = dist.get_world_size()
    environ = dict(os.environ)
    try:
        accelerator = Accelerator(deepspeed_plugin=SafeDeepSpeedPlugin(hf_ds_config=rank_dependent_config(world)))
        net = build(MODELS["moe"])
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
        loader = torch.utils.data.DataLoader(dealt_rows("moe", world), batch_size=2)
        model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
        seen, losses = [], []
        for x, y in loader:
            loss = model(x, y)
            accelerator.backward(loss)  # DeepSpeed's backward and step
            optimizer.step()
            optimizer.zero_grad()
            seen.append(x.clone())
            losses.append(loss.item())
        return {"rank": accelerator.process_index, "world": accelerator.num_processes, "seen": seen,
                "losses": losses, "safe": hasattr(model, "safe_zero_session"),
                "engaged": sorted(model.safe_zero_session.report) if hasattr(model, "safe_zero_session") else [],
                "params": {n: p.detach().float().clone() for n, p in model.module.named_parameters()}}
    finally:  # leave the pool's process as it was for the next test
        AcceleratorState._reset_state(reset_partial_state=True)
        uninstall_on_request()
        os.environ.clear()
        os.environ.update(environ)


def test_accelerate_trains_rank_dependent_experts_as_one_process_on_the_global_batch(ranks):
    for r in ranks.run(2, _accelerate_trains_rank_dependent_experts):
        assert (r["world"], r["safe"], len(r["losses"])) == (2, True, STEPS)
        assert "gradless_params" in r["engaged"], r["engaged"]
        # Accelerate's sharded loader gave each rank its own batches: the ones the reference trains rank r on.
        assert_trained_on_its_batches_as_the_reference(r, "moe", 2)
