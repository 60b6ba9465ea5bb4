"""Parameters that some ranks use and others don't: the models by name, each rank's micro-batches, and DDP's
answer to check a run against.

The answer (``reference``) is one process training plain ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) in fp32 on
the global batch (the mean of the ranks' losses), where a parameter a rank did not use contributes nothing: exactly
DDP with ``find_unused_parameters=True``. ``tests/fixes/test_gradless_params_ranks.py`` trains these models on every
ZeRO route; the integrations' tests (Accelerate, HF Trainer, Lightning) train them through their own loaders over
``dealt_rows``.
"""

from __future__ import annotations

import torch

from tests.support.models import (CheckpointedMoE, CheckpointedTower, ExpertMoE, ForeignReadingTower, FrozenTower,
                                  FunctionalReadingTower, LateCheckpointedMoE, MovingScale, NonReentrantCheckpointedMoE,
                                  OptionalTower, ReadingTower, RootExperts, SometimesShifted, TiedTower, VideoTower,
                                  WholeReadingTower, build, expert_batch)

STEPS = 3
TOLERANCE = 1e-5
LR = 1e-2
#: experts each rank's tokens are routed to: every expert is used somewhere, every rank misses two.
ROUTES = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]], 3: [[0, 1], [2, 3], [1, 2]]}
#: ``tower-late``: every rank carries an image in the first step only, then none (the same on every rank);
#: ``tower-skip-later``: every rank carries one in the first step, then rank 1 never again.
#: ``tower-rotating`` (``tower-reads-rotating``: ``ReadingTower``): every rank carries one in the first step, then the
#: ranks that do alternate (step 2: the odd ranks, step 3: the even ones); ``tower-checkpointed-rotating``
#: (``CheckpointedTower``), ``tower-frozen-rotating`` (``FrozenTower``) alike.
#: ``video-first`` (``VideoTower``): rank 0 carries an image and a video in the first step, the others an image; then
#: the ranks' runs of the tower change (``VIDEO_RUNS``). ``video-later``: every rank carries an image in the first step.
#: ``moe-shuffled``: each step every rank's experts move one on, so hooks fire in other orders than in the first step.
#: ``tower-moving``: the ranks that carry an image change every step.
#: ``shift``: ``body.shift`` is used by rank 0 in the first step and skipped by some rank in each later one;
#: ``shift-later``: rank 0 skips it in the first step. ``moving``: ``body.scale``'s gradient arrives before the
#: child's gathers in even steps and after them in odd ones, alike on every rank; ``moving-rank1``: on rank 1 only.
#: ``moe-dense``, ``shift-all``, ``tower-all``: every rank uses every parameter in every step (stock is right there).
#: ``moe-root``: the experts of ``moe`` hang off the model's root.
MODELS = {"moe": ExpertMoE, "moe-dense": ExpertMoE, "moe-shuffled": ExpertMoE, "moe-checkpointed": CheckpointedMoE,
          "moe-checkpointed-nonreentrant": NonReentrantCheckpointedMoE,
          "moe-checkpointed-late": LateCheckpointedMoE,
          "tower": OptionalTower, "tower-late": OptionalTower, "tower-skip-later": OptionalTower,
          "tower-moving": OptionalTower, "shift": SometimesShifted, "shift-later": SometimesShifted,
          "moving": MovingScale, "moving-rank1": MovingScale, "shift-all": SometimesShifted,
          "tower-all": OptionalTower, "moe-root": RootExperts, "tower-reads": ReadingTower,
          "tower-rotating": OptionalTower, "tower-reads-rotating": ReadingTower,
          "tower-checkpointed-rotating": CheckpointedTower, "tower-frozen-rotating": FrozenTower,
          "video-first": VideoTower, "video-later": VideoTower,
          "tower-reads-foreign": ForeignReadingTower, "tower-tied": TiedTower,
          "tower-functional": FunctionalReadingTower, "tower-whole-reads": WholeReadingTower}


#: Per step, each rank's runs of ``VideoTower``'s tower (rank 3 takes rank 0's): 2 an image and a video, 1 an image, 0
#: text only.
VIDEO_RUNS = {"video-first": [(2, 1, 1), (1, 2, 0), (0, 1, 2)], "video-later": [(1, 1, 1), (1, 2, 0), (2, 0, 1)]}


def _carries_an_image(model: str, rank: int, micro: int) -> bool:
    if model == "tower-moving":
        return (rank + micro) % 2 == 0
    if model in ("tower-all", "tower-late"):
        return model == "tower-all" or micro == 0
    if model == "tower-skip-later":
        return micro == 0 or rank != 1
    if model.endswith("-rotating"):
        return micro == 0 or (rank + micro) % 2 == 0
    return rank % 2 == 0  # odd ranks carry no image


def _video_batch(model: str, rank: int, micro: int, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> tuple:
    runs = VIDEO_RUNS[model][micro % STEPS][rank % 3]
    image = torch.randn(2, 4, generator=g) if runs >= 1 else None
    return x, y, image, torch.randn(2, 4, generator=g) if runs == 2 else None


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
    if model.startswith("video"):
        return _video_batch(model, rank, micro, x, y, g)
    if model.startswith("shift"):
        return x, y, model == "shift-all" or (rank + micro) % 3 != (0 if model == "shift-later" else 2)
    if model.startswith("moving"):
        return x, y, micro % 2 == 1 and (model == "moving" or rank == 1)
    image = torch.randn(2, 4, generator=g) if _carries_an_image(model, rank, micro) else None
    return x, y, image


def dealt_rows(model: str, world_size: int, steps: int = STEPS, by: str = "batch") -> list[tuple]:
    """Every rank's ``micro_batch`` of every step as one dataset of ``(x, y)`` rows, laid out so that a
    data-parallel loader over it (no shuffling, 2 rows a batch) hands each rank its own: ``by="batch"`` for a loader
    that deals whole batches round-robin (Accelerate's ``BatchSamplerShard``), ``by="sample"`` for one that deals
    rows (``DistributedSampler``, as Lightning injects it). What the integrations' rank-dependent tests train on."""
    batches = {(r, s): micro_batch(model, r, world_size, s) for r in range(world_size) for s in range(steps)}
    rows = len(batches[0, 0][0])
    order = ([(r, s, i) for s in range(steps) for r in range(world_size) for i in range(rows)] if by == "batch" else
             [(r, s, i) for s in range(steps) for i in range(rows) for r in range(world_size)])
    return [(batches[r, s][0][i], batches[r, s][1][i]) for r, s, i in order]


def assert_trained_on_its_batches_as_the_reference(result: dict, model: str, world_size: int) -> None:
    """One rank of an integration's run over ``dealt_rows``: its loader handed it its own ``micro_batch`` each step
    (``result["seen"]``), and its parameters after ``STEPS`` are the single-process reference's."""
    assert len(result["seen"]) == STEPS, len(result["seen"])
    for step, x in enumerate(result["seen"]):
        assert torch.equal(x, micro_batch(model, result["rank"], world_size, step)[0]), (result["rank"], step)
    assert max_error(result, reference(model, world_size)) < TOLERANCE


def config(stage: int, world_size: int, accumulation: int = 1, safe_zero: dict | None = None, *,
           dtype: str = "fp32", optimizer: str = "adamw", **zero) -> dict:
    """``optimizer="sgd"``: the engine gets a client ``torch.optim.SGD`` (``test_gradless_params_ranks._train``) and
    no clipping, so an update is ``-LR`` times the reduced gradient: a gradient-scale error shows in the parameters at
    full size."""
    return {
        **({"safe_zero": safe_zero} if safe_zero else {}),
        "train_batch_size": 2 * accumulation * world_size,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        **({"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "gradient_clipping": 1.0} if optimizer == "adamw" else
           {"gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}),
        **({"bf16": {"enabled": True}} if dtype == "bf16" else {}),
        "zero_optimization": {"stage": stage, **zero},
        "steps_per_print": 10**9,
    }


def reference(model: str, world_size: int, accumulation: int = 1, optimizer: str = "adamw") -> dict[str, torch.Tensor]:
    """Single-process fp32 training on the global batch: AdamW + ``clip_grad_norm_`` as configured above, or
    (``optimizer="sgd"``) plain SGD without clipping."""
    net = build(MODELS[model])
    trainable = [p for p in net.parameters() if p.requires_grad]
    adamw = optimizer == "adamw"
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0) if adamw else torch.optim.SGD(trainable, lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulation):
            losses = [net(*micro_batch(model, r, world_size, step * accumulation + micro)) for r in range(world_size)]
            (torch.stack(losses).mean() / accumulation).backward()
        for p in trainable:  # ZeRO steps whole flat groups: a parameter no rank used gets a zero gradient, not None
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if adamw:
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def max_error(result: dict, expected: dict[str, torch.Tensor]) -> float:
    return max((result["params"][n] - expected[n]).abs().max().item() for n in expected if n in result["params"])


def rank_dependent_config(world_size: int) -> dict:
    """``config``'s ZeRO-2 fp32 run (clipping at 1.0) with the optimizer left to the client: a ``torch.optim.AdamW``
    as the reference's, which DeepSpeed takes as an untested ZeRO optimizer (the integrations' runs)."""
    ds = config(2, world_size)
    del ds["optimizer"]
    return {**ds, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
