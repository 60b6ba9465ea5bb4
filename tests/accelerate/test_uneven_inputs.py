"""``accelerator.join_uneven_inputs([model], even_batches=False)`` under DeepSpeed with safe_zero's engine: the
ranks' loaders hand out different numbers of batches and training equals single-process AdamW on the batches the
ranks saw, divided by the world size (``Join``'s default); stock Accelerate only warns there and does not join."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")

from tests.support.models import build  # noqa: E402
from tests.support.uneven_inputs import LR, TOLERANCE, Regression, config, max_error  # noqa: E402

ROWS = 10  # 5 batches of 2, dealt round-robin: rank 0 gets 3, rank 1 gets 2


def rows() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, generator=g), torch.randn(1, generator=g)) for _ in range(ROWS)]


def _accelerate_joins(stage: int) -> dict:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from safe_zero.accelerate import SafeDeepSpeedPlugin

    world = dist.get_world_size()
    environ = dict(os.environ)
    try:
        ds = config(stage, world, 1, "fp32")
        accelerator = Accelerator(deepspeed_plugin=SafeDeepSpeedPlugin(hf_ds_config=ds))
        loader = torch.utils.data.DataLoader(rows(), batch_size=2)
        model, loader = accelerator.prepare(build(Regression), loader)
        batches = 0
        with accelerator.join_uneven_inputs([model], even_batches=False):
            for x, y in loader:
                accelerator.backward(model(x, y))  # DeepSpeed's backward and step
                batches += 1
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.module.parameters()), enabled=stage == 3):
            params = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
        return {"batches": batches, "steps": model.global_steps, "params": params}
    finally:  # leave the pool's process as it was for the next test
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environ)


def reference(world_size: int) -> dict[str, torch.Tensor]:
    data = rows()
    batches = [data[k:k + 2] for k in range(0, ROWS, 2)]
    net = build(Regression)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    for step in range(0, len(batches), world_size):
        losses = [net(torch.stack([x for x, _ in b]), torch.stack([y for _, y in b]))
                  for b in batches[step:step + world_size]]
        (torch.stack(losses).sum() / world_size).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_joins_safe_zero_engines_on_uneven_loaders(ranks, stage):
    results = ranks.run(2, _accelerate_joins, stage=stage, timeout=120)
    assert [r["batches"] for r in results] == [3, 2]
    assert {r["steps"] for r in results} == {3}
    for r in results:
        assert max_error(r["params"], reference(2)) < TOLERANCE
