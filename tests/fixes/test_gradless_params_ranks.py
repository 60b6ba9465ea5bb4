"""Parameters that some ranks use and others don't: DDP's answer, checked against single-process training.

Each rank trains on its own micro-batches; the reference is one process training plain ``torch.optim.AdamW``
(+ ``clip_grad_norm_``) in fp32 on the global batch (the mean of the ranks' losses), where a parameter a rank
did not use contributes nothing -- exactly DDP with ``find_unused_parameters=True``. Two models:
``ExpertMoE`` (each rank's tokens go to two of four experts, every expert used somewhere each step) and
``OptionalTower`` (rank 1 has no image, so its tower never runs there).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from safe_zero._compat import DEEPSPEED_VERSION
from safe_zero.errors import ReentrantCheckpointWarning
from safe_zero.fixes import flat_buffer_autograd
from tests.models import (CheckpointedMoE, ExpertMoE, LateCheckpointedMoE, MovingScale, NonReentrantCheckpointedMoE,
                          OptionalTower, SometimesShifted, build, expert_batch)
from tests.rig import RankFailure

STEPS = 3
TOLERANCE = 1e-5
LR = 1e-2
#: experts each rank's tokens are routed to: every expert is used somewhere, every rank misses two.
ROUTES = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]], 3: [[0, 1], [2, 3], [1, 2]]}
#: ``tower-late``: every rank carries an image in the first step only, then none (the same on every rank);
#: ``tower-skip-later``: every rank carries one in the first step, then rank 1 never again.
#: ``moe-shuffled``: each step every rank's experts move one on, so hooks fire in other orders than in the first step.
#: ``tower-moving``: the ranks that carry an image change every step.
#: ``shift``: ``body.shift`` is used by rank 0 in the first step and skipped by some rank in each later one;
#: ``shift-later``: rank 0 skips it in the first step. ``moving``: ``body.scale``'s gradient arrives before the
#: child's gathers in even steps and after them in odd ones, alike on every rank; ``moving-rank1``: on rank 1 only.
MODELS = {"moe": ExpertMoE, "moe-dense": ExpertMoE, "moe-shuffled": ExpertMoE, "moe-checkpointed": CheckpointedMoE, "moe-checkpointed-nonreentrant": NonReentrantCheckpointedMoE,
          "moe-checkpointed-late": LateCheckpointedMoE,
          "tower": OptionalTower, "tower-late": OptionalTower, "tower-skip-later": OptionalTower,
          "tower-moving": OptionalTower, "shift": SometimesShifted, "shift-later": SometimesShifted,
          "moving": MovingScale, "moving-rank1": MovingScale}


def micro_batch(model: str, rank: int, world_size: int, micro: int) -> tuple:
    """The inputs of ``rank`` at micro-step ``micro`` (the same on every run)."""
    seed = 1000 * micro + rank
    if model == "moe-dense":  # every rank routes tokens to every expert
        return expert_batch(ROUTES[1][0], seed)
    if model == "moe-shuffled":
        return expert_batch([(e + micro) % 4 for e in ROUTES[world_size][rank]], seed)
    if model.startswith("moe"):
        return expert_batch(ROUTES[world_size][rank], seed)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)
    if model.startswith("shift"):
        return x, y, (rank + micro) % 3 != (0 if model == "shift-later" else 2)
    if model.startswith("moving"):
        return x, y, micro % 2 == 1 and (model == "moving" or rank == 1)
    if model == "tower-moving":
        carries = (rank + micro) % 2 == 0
    elif model == "tower-late":
        carries = micro == 0
    elif model == "tower-skip-later":
        carries = micro == 0 or rank != 1
    else:
        carries = rank % 2 == 0  # odd ranks carry no image
    image = torch.randn(2, 4, generator=g) if carries else None
    return x, y, image


def config(stage: int, world_size: int, accumulation: int = 1, safe_zero: dict | None = None, **zero) -> dict:
    return {
        **({"safe_zero": safe_zero} if safe_zero else {}),
        "train_batch_size": 2 * accumulation * world_size,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **zero},
        "steps_per_print": 10**9,
    }


def _train(model: str, stage: int, safe: bool, world_size: int, accumulation: int = 1, options: dict | None = None,
           **zero) -> dict:
    import deepspeed
    import torch.distributed as dist

    import safe_zero

    rank = dist.get_rank()
    net = build(MODELS[model])
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                      config=config(stage, world_size, accumulation, options, **zero))
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReentrantCheckpointWarning)
        for step in range(STEPS):
            for micro in range(accumulation):
                loss = engine(*micro_batch(model, rank, world_size, step * accumulation + micro))
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        state = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    report = dict(getattr(engine, "safe_zero_session", None).report) if safe else {}
    warned = [str(w.message) for w in caught if issubclass(w.category, ReentrantCheckpointWarning)]
    return {"params": state, "losses": losses, "report": report, "warned": warned}


def _cpu_skips_uncontiguous_all_reduce() -> bool:
    from deepspeed.runtime.zero.stage_1_and_2 import split_half_float_double

    return split_half_float_double([torch.zeros(1)]) == []


def reference(model: str, world_size: int, accumulation: int = 1) -> dict[str, torch.Tensor]:
    """Single-process fp32 AdamW on the global batch."""
    net = build(MODELS[model])
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(accumulation):
            losses = [net(*micro_batch(model, r, world_size, step * accumulation + micro)) for r in range(world_size)]
            (torch.stack(losses).mean() / accumulation).backward()
        for p in trainable:  # ZeRO steps whole flat groups: a parameter no rank used gets a zero gradient, not None
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def max_error(result: dict, expected: dict[str, torch.Tensor]) -> float:
    return max((result["params"][n] - expected[n]).abs().max().item() for n in expected)


ZERO12_ROUTES = {
    "stage1": dict(stage=1),
    "stage1-overlap": dict(stage=1, overlap_comm=True),
    "stage2": dict(stage=2),
    "stage2-overlap": dict(stage=2, overlap_comm=True),
    "stage2-no-contiguous": dict(stage=2, contiguous_gradients=False),
    "stage2-round-robin": dict(stage=2, round_robin_gradients=True),
    "stage2-small-buckets": dict(stage=2, reduce_bucket_size=40, allgather_bucket_size=40),
    "stage2-offload": dict(stage=2, offload_optimizer={"device": "cpu"}),
}


@pytest.mark.parametrize("route", [r for r in ZERO12_ROUTES if r != "stage2-small-buckets"])  # that one crashes
def test_stock_zero12_trains_an_moe_with_rank_dependent_experts_silently_wrong(ranks, route):
    kwargs = ZERO12_ROUTES[route]
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):  # 0.18.7-0.18.x: stock ZeRO-1/2 stops earlier on gloo
        with pytest.raises(RankFailure, match="Output 0 of Split is a view"):
            ranks.run(2, _train, model="moe", safe=False, world_size=2, **kwargs)
        return
    results = ranks.run(2, _train, model="moe", safe=False, world_size=2, **kwargs)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results), "stock runs without an error"
    assert max_error(results[0], reference("moe", 2)) > 1e-3, "stock ZeRO mixes up the ranks' expert gradients"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", list(ZERO12_ROUTES))
def test_safe_zero12_is_ddp_exact_on_an_moe_with_rank_dependent_experts(ranks, route, world_size):
    if route == "stage2-no-contiguous" and _cpu_skips_uncontiguous_all_reduce():
        pytest.xfail("this DeepSpeed never all-reduces ZeRO-2 gradients with contiguous_gradients=false on the CPU "
                     "accelerator (split_half_float_double matches no CPU tensor type): every rank trains on its own "
                     "gradient, stock or safe_zero; CUDA is not affected")
    results = ranks.run(world_size, _train, model="moe", safe=True, world_size=world_size, **ZERO12_ROUTES[route])
    expected = reference("moe", world_size)
    for r in results:
        assert max_error(r, expected) < TOLERANCE
    assert "gradless_params" in results[0]["report"]


def test_stock_zero12_trains_experts_that_move_between_ranks_silently_wrong(ranks):
    if flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):  # 0.18.7-0.18.x: stock ZeRO-1/2 stops earlier on gloo
        with pytest.raises(RankFailure, match="Output 0 of Split is a view"):
            ranks.run(2, _train, model="moe-shuffled", safe=False, world_size=2, stage=2, overlap_comm=True)
        return
    results = ranks.run(2, _train, model="moe-shuffled", safe=False, world_size=2, stage=2, overlap_comm=True)
    assert max_error(results[0], reference("moe-shuffled", 2)) > 1e-3


@pytest.mark.parametrize("route", ["stage1", "stage2-overlap"])
def test_a_model_every_rank_uses_fully_trains_as_stock_does_at_three_ranks(ranks, route):
    """Never worse than stock: where stock is already DDP-exact, so is safe_zero's agreed order (world size 3)."""
    expected = reference("moe-dense", 3)
    for r in ranks.run(3, _train, model="moe-dense", safe=True, world_size=3, **ZERO12_ROUTES[route]):
        assert max_error(r, expected) < TOLERANCE
    if not flat_buffer_autograd.FIX.needed(DEEPSPEED_VERSION):  # stock ZeRO-1/2 cannot step at 3 gloo ranks there
        for r in ranks.run(3, _train, model="moe-dense", safe=False, world_size=3, **ZERO12_ROUTES[route]):
            assert max_error(r, expected) < TOLERANCE


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", ["stage1-overlap", "stage2", "stage2-overlap", "stage2-round-robin"])
def test_safe_zero12_is_ddp_exact_when_the_ranks_use_other_parameters_every_step(ranks, route, world_size):
    """After the first step the ranks walk one agreed reduction order without a collective: hooks that fire in
    another order than rank 0's first-step order wait their turn, unused parameters go as zeros in theirs."""
    results = ranks.run(world_size, _train, model="moe-shuffled", safe=True, world_size=world_size,
                        **ZERO12_ROUTES[route])
    expected = reference("moe-shuffled", world_size)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage,overlap", [(1, False), (1, True), (2, False), (2, True)])
def test_safe_zero12_is_ddp_exact_with_gradient_accumulation(ranks, stage, overlap, world_size):
    results = ranks.run(world_size, _train, model="moe", safe=True, world_size=world_size, accumulation=2,
                        stage=stage, overlap_comm=overlap)
    expected = reference("moe", world_size, accumulation=2)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


def test_every_rank_using_every_expert_matches_the_reference_on_stock_too(ranks):
    """The control: with one rank the reference and DeepSpeed agree, stock or not, so the reference is right."""
    results = ranks.run(1, _train, model="moe", safe=False, world_size=1, stage=2)
    assert max_error(results[0], reference("moe", 1)) < TOLERANCE


def test_stock_zero3_stops_on_rank_dependent_experts(ranks):
    # One rank raises within seconds (at step 2), the other waits in a collective until the pool's timeout.
    with pytest.raises((RankFailure, TimeoutError), match="Detected a disagreement on list contents"):
        ranks.run(2, _train, model="moe", safe=False, world_size=2, stage=3, timeout=20)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("persistence", [0, None])
def test_safe_zero3_gathers_moe_blocks_whole_and_is_ddp_exact(ranks, world_size, persistence):
    zero = {} if persistence is None else {"stage3_param_persistence_threshold": persistence}
    results = ranks.run(world_size, _train, model="moe", safe=True, world_size=world_size, stage=3, **zero)
    expected = reference("moe", world_size)
    for r in results:
        assert max_error(r, expected) < TOLERANCE
    assert any("MoE block(s) gathered whole" in what for what in results[0]["report"]["gradless_params"])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage,overlap", [(1, False), (1, True), (2, False), (2, True)])
def test_safe_zero12_is_ddp_exact_on_an_optional_tower(ranks, stage, overlap, world_size):
    results = ranks.run(world_size, _train, model="tower", safe=True, world_size=world_size, stage=stage,
                        overlap_comm=overlap)
    expected = reference("tower", world_size)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


def test_stock_zero3_fails_on_an_optional_tower(ranks):
    # The rank that runs the tower gathers its parameters, the other the head's: gloo aborts one process
    # ("Received data size doesn't match expected size. Is there a distributed collective mismatch"), or one
    # rank waits in the collective until the pool's timeout.
    with pytest.raises((RuntimeError, TimeoutError), match="pool died|did not finish|mismatch|disagreement"):
        ranks.run(2, _train, model="tower", safe=False, world_size=2, stage=3, timeout=20)


def test_stock_zero12_fails_on_an_optional_tower(ranks):
    # The ranks' buckets hold different parameters, so their all-reduces differ in size: gloo aborts a process
    # ("Connection reset by peer", or a size mismatch) while the other waits. DeepSpeed 0.18.7-0.18.x stops earlier.
    with pytest.raises((RuntimeError, TimeoutError),
                       match="pool died|did not finish|mismatch|Connection reset|Output 0 of Split is a view"):
        ranks.run(2, _train, model="tower", safe=False, world_size=2, stage=2, timeout=20)


@pytest.mark.parametrize("world_size", [2, 3])
def test_safe_zero3_stops_on_an_optional_tower_naming_the_module_and_the_setting(ranks, world_size):
    with pytest.raises(RankFailure) as failure:
        ranks.run(world_size, _train, model="tower", safe=True, world_size=world_size, stage=3, timeout=60)
    message = str(failure.value)
    assert "RankDivergenceError" in message and "rank 0 `tower.0`" in message and "rank 1 `head`" in message
    assert '"optional_modules": ["tower"]' in message


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("persistence", [0, None])
def test_safe_zero3_is_ddp_exact_on_an_optional_tower_listed_in_optional_modules(ranks, world_size, persistence):
    zero = {} if persistence is None else {"stage3_param_persistence_threshold": persistence}
    results = ranks.run(world_size, _train, model="tower", safe=True, world_size=world_size, stage=3,
                        options={"optional_modules": ["tower"]}, **zero)
    expected = reference("tower", world_size)
    for r in results:
        assert max_error(r, expected) < TOLERANCE
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert any("optional module(s) tower kept gathered" in what for what in results[0]["report"]["gradless_params"])


#: ZeRO-3 with every parameter partitioned, released after each use, never prefetched (this model is small enough to
#: be prefetched whole) and reduced in buckets of 12 elements: every backward gathers module by module, with bucket
#: flushes between those gathers.
GATHERING = dict(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0,
                 reduce_bucket_size=12)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model", ["shift", "shift-later"])
def test_safe_zero3_is_ddp_exact_when_a_module_every_rank_runs_uses_a_parameter_on_some(ranks, model, world_size):
    """From the second step each rank walks the agreed order on the module clock, without a collective: a parameter
    it did not use goes out as zeros before the gathers of the module that follows rank 0's hook for it (``shift``),
    or at the end of the backward where rank 0 did not reach it in the first step (``shift-later``)."""
    results = ranks.run(world_size, _train, model=model, safe=True, world_size=world_size, stage=3, timeout=90,
                        **GATHERING)
    expected = reference(model, world_size)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


@pytest.mark.parametrize("route", ["accumulation", "offload"])
def test_safe_zero3_walk_is_ddp_exact_with_gradient_accumulation_and_cpu_offload(ranks, route):
    """Every micro-step's backward reduces on ZeRO-3, so each one walks; with the optimizer on the CPU the
    reductions feed the offloaded partitions."""
    accumulation = 2 if route == "accumulation" else 1
    zero = dict(offload_optimizer={"device": "cpu"}) if route == "offload" else {}
    results = ranks.run(2, _train, model="shift", safe=True, world_size=2, stage=3, accumulation=accumulation,
                        timeout=90, **GATHERING, **zero)
    expected = reference("shift", 2, accumulation=accumulation)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


def test_stock_zero3_fails_when_a_module_every_rank_runs_uses_a_parameter_on_some(ranks):
    # Rank 1 skips body.shift in step 2: even in the default single bucket its reduce-scatter is smaller than rank
    # 0's, and gloo aborts a process (with GATHERING the ranks' flushes and gathers no longer pair up: a hang).
    with pytest.raises((RuntimeError, TimeoutError), match="pool died|did not finish|mismatch|Connection reset"):
        ranks.run(2, _train, model="shift", safe=False, world_size=2, stage=3, timeout=20)


@pytest.mark.parametrize("world_size", [2, 3])
def test_safe_zero3_is_ddp_exact_when_the_ranks_that_run_an_optional_module_change(ranks, world_size):
    results = ranks.run(world_size, _train, model="tower-moving", safe=True, world_size=world_size, stage=3,
                        options={"optional_modules": ["tower"]}, timeout=90, **GATHERING)
    expected = reference("tower-moving", world_size)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


def test_safe_zero3_waits_for_a_gradient_that_moves_past_a_gather_on_every_rank_alike(ranks):
    """In step 2 ``body.scale``'s gradient arrives after ``body.child``'s gathers, where the agreed order has it
    before them, on every rank alike: every rank's walk waits for it, so they still reduce in one order."""
    results = ranks.run(2, _train, model="moving", safe=True, world_size=2, stage=3, timeout=90, **GATHERING)
    expected = reference("moving", 2)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


@pytest.mark.parametrize("safe", [False, True])
def test_zero3_trains_a_gradient_that_moves_on_one_rank_as_stock_does(ranks, safe):
    """Only rank 1's ``body.scale`` gradient moves. With one bucket per backward stock DeepSpeed reduces it sorted by
    parameter, so where it arrives does not matter; safe_zero's walk waits for it on rank 1 only and trains the same."""
    results = ranks.run(2, _train, model="moving-rank1", safe=safe, world_size=2, stage=3)
    expected = reference("moving-rank1", 2)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


@pytest.mark.parametrize("safe", [False, True])
def test_zero3_module_order_that_changes_on_every_rank_alike(ranks, safe):
    """Every rank drops the tower after the first step: DeepSpeed records its trace again, on every rank alike.
    safe_zero's ranks find through the store that all left the order at the same module and go on; the tower,
    used by no rank, takes zero gradients: DDP-exact. Stock trains on but not to the reference."""
    results = ranks.run(2, _train, model="tower-late", safe=safe, world_size=2, stage=3)
    expected = reference("tower-late", 2)
    for r in results:
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        if safe:
            assert max_error(r, expected) < TOLERANCE
        else:
            assert max_error(r, expected) > 1e-4


def test_zero3_a_rank_that_skips_a_module_after_the_first_step_stops_instead_of_hanging(ranks):
    """The trace recorded the tower on every rank; from step 2 rank 1 skips it. Rank 1 waits the configured
    time for another rank to leave the order too, then raises naming the tower; rank 0 is left in its gather
    (a launcher ends the job when rank 1 exits; the pool here gives up after its timeout)."""
    expected = r'rank 1: RankDivergenceError: .*entered `head` where .* has `tower`.*"optional_modules": \["tower"\]'
    with pytest.raises(TimeoutError, match=expected):
        ranks.run(2, _train, model="tower-skip-later", safe=True, world_size=2, stage=3,
                  options={"module_order_timeout": 3}, timeout=15)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("route", ["stage1-overlap", "stage2", "stage2-overlap", "stage3"])
def test_activation_checkpointing_is_ddp_exact(ranks, route, reentrant):
    """Reentrant: the checkpointed block's gradients arrive in a nested backward (another graph task) of the same
    step, and wait for the epilogue (with a warning). Non-reentrant: one graph task, nothing changes."""
    kwargs = dict(stage=3) if route == "stage3" else ZERO12_ROUTES[route]
    model = "moe-checkpointed" if reentrant else "moe-checkpointed-nonreentrant"
    results = ranks.run(2, _train, model=model, safe=True, world_size=2, **kwargs)
    expected = reference(model, 2)
    for r in results:
        assert max_error(r, expected) < TOLERANCE
        assert bool(r["warned"]) == reentrant, r["warned"]


@pytest.mark.parametrize("stage", [2, 3])
def test_reentrant_checkpointing_turned_on_after_the_first_step_stops_with_what_to_do(ranks, stage):
    """The agreed order is walked without a collective, trusting the outer graph for what a rank reaches; a nested
    backward that begins later reaches parameters already reduced as zeros, and the step stops before its update."""
    with pytest.raises(RankFailure, match="nested backward.*use_reentrant=False"):
        ranks.run(2, _train, model="moe-checkpointed-late", safe=True, world_size=2, stage=stage)


@pytest.mark.parametrize("stage", [2, 3])
def test_find_unused_parameters_false_trains_a_model_every_rank_uses_without_the_agreement(ranks, stage):
    results = ranks.run(2, _train, model="moe-dense", safe=True, world_size=2, stage=stage,
                        options={"find_unused_parameters": False})
    expected = reference("moe-dense", 2)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_find_unused_parameters_false_refuses_a_parameter_some_rank_did_not_use(ranks, stage):
    # ZeRO-3 gathers MoE blocks whole (leaf modules, zero-filled by DeepSpeed): its case is the listed tower.
    model, options = ("tower", {"optional_modules": ["tower"]}) if stage == 3 else ("moe", {})
    zero = {"overlap_comm": True} if stage == 1 else {}
    # The check is local (no collective): the rank that missed the parameter raises; at ZeRO-3 the other one
    # waits in its next gather until the pool gives up (a launcher ends the job when a rank exits).
    with pytest.raises((RankFailure, TimeoutError), match="UnusedParameterError.*find_unused_parameters"):
        ranks.run(2, _train, model=model, safe=True, world_size=2, stage=stage,
                  options={"find_unused_parameters": False, **options}, timeout=20, **zero)


def _optional_tower_round_trip(directory: str) -> dict:
    """2 steps, save, ``empty_partition_cache``, a 3rd step; a fresh engine loads the checkpoint and takes the same 3rd step."""
    import deepspeed
    import torch.distributed as dist

    import safe_zero

    rank = dist.get_rank()

    def engine(seed: int):
        net = build(OptionalTower, seed=seed)
        # A config per engine: DeepSpeed 0.18 pops "torch_adam" from the dict it is given.
        return safe_zero.initialize(model=net, model_parameters=list(net.parameters()),
                                    config=config(3, 2, 1, {"optional_modules": ["tower"]}))[0]

    def step(e, micro: int) -> float:
        loss = e(*micro_batch("tower", rank, 2, micro))
        e.backward(loss)
        e.step()
        return loss.item()

    def params(e) -> dict:
        with deepspeed.zero.GatheredParameters(list(e.module.parameters())):
            return {n: p.detach().clone() for n, p in e.module.named_parameters()}

    first = engine(0)
    step(first, 0)
    step(first, 1)
    first.save_checkpoint(directory, tag="t")
    first.empty_partition_cache()  # releases the kept tower too: the next forward gathers it again
    losses = [step(first, 2), step(first, 3)]
    resumed = engine(1)
    resumed.load_checkpoint(directory, tag="t")
    resumed_losses = [step(resumed, 2), step(resumed, 3)]
    return {"losses": losses, "resumed": resumed_losses, "params": params(first), "resumed_params": params(resumed)}


def test_optional_modules_survive_a_checkpoint_round_trip_and_an_emptied_cache(ranks, tmp_path):
    try:
        results = ranks.run(2, _optional_tower_round_trip, directory=str(tmp_path / "first"))
    except RuntimeError as error:
        # Once, in a fresh-clone CI run, a worker of the shared 2-rank pool died here without output (not
        # reproduced alone or with this file). One retry on a fresh pool; a real failure fails both times.
        if "pool died" not in str(error):
            raise
        results = ranks.run(2, _optional_tower_round_trip, directory=str(tmp_path / "second"))
    for r in results:
        assert r["resumed"] == r["losses"]
        assert all(torch.equal(r["params"][n], r["resumed_params"][n]) for n in r["params"])


CHUNKS = 2


def _train_coalesced(model: str, stage: int, safe: bool = True, options: dict | None = None, **zero) -> dict:
    """``_train``'s steps inside DeepSpeed's ``coalesce_grad_reduction``: ``CHUNKS`` backwards per block (each
    loss divided by ``CHUNKS``, so a step is the reference's accumulated step), one flush at the block's exit that
    calls the reduce hooks outside any graph task, then one optimizer step."""
    import deepspeed
    import torch.distributed as dist

    import safe_zero

    rank = dist.get_rank()
    net = build(MODELS[model])
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                      config=config(stage, 2, safe_zero=options, **zero))
    losses = []
    for step in range(STEPS):
        with engine.coalesce_grad_reduction():
            for chunk in range(CHUNKS):
                loss = engine(*micro_batch(model, rank, 2, step * CHUNKS + chunk))
                engine.set_gradient_accumulation_boundary(chunk == CHUNKS - 1)
                engine.backward(loss / CHUNKS)
                losses.append(loss.item())
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return {"params": {n: p.detach().float().clone() for n, p in engine.module.named_parameters()},
                "losses": losses}


needs_coalesce = pytest.mark.skipif(not hasattr(__import__("deepspeed").DeepSpeedEngine, "coalesce_grad_reduction"),
                                    reason="this DeepSpeed has no coalesce_grad_reduction")


@needs_coalesce
@pytest.mark.parametrize("stage", [2, 3])
def test_coalesced_grad_reduction_flush_is_ddp_exact(ranks, stage):
    # Before the fix the ZeRO-3 flush asked autograd for reachability outside a backward and raised
    # "_get_should_execute_nodes should only be called during the backward pass" (DeepSpeed's own coalesce tests).
    results = ranks.run(2, _train_coalesced, model="moe-dense", stage=stage)
    expected = reference("moe-dense", 2, accumulation=CHUNKS)
    for r in results:
        assert max_error(r, expected) < TOLERANCE


@needs_coalesce
@pytest.mark.parametrize("route", ["stage1", "stage2", "stage2-overlap"])
def test_stock_coalesced_flush_trains_rank_dependent_experts_silently_wrong(ranks, route):
    # The flush reduces only the parameters with a gradient on each rank, in parameter order: rank 0's experts
    # 0-1 meet rank 1's experts 2-3 at the same bucket offsets.
    results = ranks.run(2, _train_coalesced, model="moe", safe=False, **ZERO12_ROUTES[route])
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results), "stock runs without an error"
    assert max_error(results[0], reference("moe", 2, accumulation=CHUNKS)) > 1e-3


@needs_coalesce
@pytest.mark.parametrize("model,route", [("moe", "stage1"), ("moe", "stage1-overlap"), ("moe", "stage2"),
                                         ("moe", "stage2-overlap"), ("tower", "stage2"), ("moe", "stage3"),
                                         ("tower", "stage3")])
def test_safe_coalesced_flush_is_ddp_exact_on_rank_dependent_parameters(ranks, model, route):
    zero = ZERO12_ROUTES[route] if route != "stage3" else {"stage": 3}
    options = {"optional_modules": ["tower"]} if model == "tower" and route == "stage3" else None
    results = ranks.run(2, _train_coalesced, model=model, options=options, **zero)
    expected = reference(model, 2, accumulation=CHUNKS)
    for r in results:
        assert max_error(r, expected) < TOLERANCE
