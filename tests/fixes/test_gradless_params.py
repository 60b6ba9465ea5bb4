"""A trainable parameter whose gradient stays None: stock ZeRO-2/3 crash, safe_zero trains and leaves it unchanged."""

import pytest
import torch

from tests.models import Gradless, build, ds_config, train
from tests.rig import RankFailure


def _train_gradless(stage: int, safe: bool, world_size: int, steps: int = 3) -> dict:
    import deepspeed

    import safe_zero

    model = build(Gradless)
    before = model.dqweight.detach().clone()
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=model.parameters(),
                      config=ds_config(stage, world_size=world_size))
    losses = train(engine, steps)
    if stage == 3:
        with deepspeed.zero.GatheredParameters([engine.module.dqweight]):
            after = engine.module.dqweight.detach().float().clone()
    else:
        after = engine.module.dqweight.detach().float().clone()
    dense_moved = engine.module.dense.weight.ds_numel if stage == 3 else None
    return {"losses": losses, "unchanged": torch.equal(after, before.to(torch.bfloat16).float()),
            "dense": dense_moved}


STOCK_ERRORS = {2: "'NoneType' object has no attribute", 3: "'NoneType' object has no attribute 'numel'"}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_stock_deepspeed_crashes_on_a_gradless_parameter(ranks, stage, world_size):
    with pytest.raises(RankFailure, match=STOCK_ERRORS[stage]):
        ranks.run(world_size, _train_gradless, stage=stage, safe=False, world_size=world_size)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_safe_zero_trains_and_leaves_the_gradless_parameter_unchanged(ranks, stage, world_size):
    results = ranks.run(world_size, _train_gradless, stage=stage, safe=True, world_size=world_size)
    for r in results:
        assert len(r["losses"]) == 3
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert r["losses"][-1] < r["losses"][0]
        assert r["unchanged"], "a parameter that never got a gradient must keep its value"
    assert results[0]["losses"] == results[-1]["losses"]
