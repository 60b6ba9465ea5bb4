"""A trainable parameter whose gradient stays None: stock ZeRO-2/3 crash, safe_zero trains and leaves it unchanged."""

import pytest
import torch

from rig import RankFailure
from tests.support.bodies import HOOK_RUNS_WITHOUT_A_GRADIENT
from tests.support.models import Gradless, build, ds_config, train


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
    if not HOOK_RUNS_WITHOUT_A_GRADIENT:
        # torch 2.4-2.6 runs no gradient hook for a None gradient: stock never reaches it, and trains the rest with
        # the parameter unchanged (its losses are not compared: stock ZeRO-3 on such a torch once gave one rank inf)
        for r in ranks.run(world_size, _train_gradless, stage=stage, safe=False, world_size=world_size):
            assert r["unchanged"] and len(r["losses"]) == 3
        return
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


def test_zero_gradients_of_a_run_share_bounded_buffers_and_keep_every_shape(monkeypatch):
    from safe_zero.fixes.gradless import gradients
    from safe_zero.session import Session

    monkeypatch.setattr(gradients, "ZERO_FILL_CHUNK", 100)
    session, reported = Session(), set()
    f32 = [torch.nn.Parameter(torch.ones(s)) for s in [(4, 5), (0, 8), (10, 3), (7, 20), (3,)]]
    bf16 = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
    released = torch.nn.Parameter(torch.ones(0))  # a ZeRO-3 parameter whose data is already released
    wanted = [(p, p.shape, "cpu", "was not used") for p in f32[:2]] + [(bf16, bf16.shape, "cpu", "was not used")] \
        + [(p, p.shape, "cpu", "was not used") for p in f32[2:]] + [(released, torch.Size((6, 2)), "cpu", "had none")]
    gradients.zero_grads_for(wanted, reported, session)

    for p, shape, _, _ in wanted:
        assert p.grad.shape == shape and p.grad.dtype == p.dtype and not p.grad.any()
    buffer = {id(p): p.grad.untyped_storage().data_ptr() for p in f32 + [bf16, released]}
    # A buffer per run of one dtype, up to 100 elements: (4, 5) + (0, 8) (which holds nothing); bf16; (10, 3), as
    # (7, 20) would overflow it; (7, 20), larger than a buffer, alone; (3,) + the released (6, 2).
    assert len({buffer[id(f32[0])], buffer[id(bf16)], buffer[id(f32[2])], buffer[id(f32[3])],
                buffer[id(f32[4])]}) == 5
    assert buffer[id(f32[4])] == buffer[id(released)]
    assert released.grad.data.shape == (6, 2)
    f32[0].grad.add_(1)  # the views do not overlap
    assert not f32[2].grad.any() and f32[0].grad.eq(1).all()
    report = session.counts["gradless_params"]
    assert report["parameter of shape (0, 8) was not used; reduced as zeros"] == 1
    assert reported == {id(p) for p, _, _, _ in wanted}
