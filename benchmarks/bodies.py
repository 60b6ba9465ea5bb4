"""The bench's models and rank bodies: each body runs on every rank of a CPU/gloo pool (``rig``).

``benchmarks/run.py`` times :func:`stepped_seconds`; ``tests/benchmarks`` asserts the deterministic costs
(collectives, first-step bytes, calls, state) on the same models and engines.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from typing import Any, Iterator

import torch
from torch import nn


class Wide(nn.Module):
    """A model stock DeepSpeed trains (no zero-sized parameters): the step-time control."""

    def __init__(self, hidden: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.pow(2).mean()


class WithEmpty(nn.Module):
    """``Wide`` plus K submodules whose only parameters are zero-sized, in the forward path."""

    def __init__(self, k: int, hidden: int = 256) -> None:
        super().__init__()
        self.body = Wide(hidden)
        self.empties = nn.ModuleList(nn.Linear(hidden, 0, bias=False) for _ in range(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + sum(e(x).sum() for e in self.empties)


class Expert(nn.Module):
    """A bias-free gated MLP, as in Mixtral/Qwen-MoE experts: 3 tensors."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


class MoEBlock(nn.Module):
    """A router and an ``experts`` ``nn.ModuleList`` (safe_zero makes this a ZeRO-3 leaf module).

    ``rank_dependent``: rank r runs only the experts e with e % world_size == r, so each rank uses other
    experts (the case stock ZeRO-1/2 reduces into each other and stock ZeRO-3 cannot gather); otherwise every
    rank runs every expert, weighted by the router (every rank uses every parameter). ``touch_unused`` (set by
    :func:`touch_unused`): each expert the rank does not run adds ``0 x sum`` of each of its parameters to the output.
    """

    #: Stock's workaround for parameters only some ranks use (as with DDP before find_unused_parameters): every
    #: parameter in every rank's graph, with an exact zero gradient where the rank did not use it.
    touch_unused = False

    def __init__(self, hidden: int, experts: int, inner: int, rank_dependent: bool) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inner) for _ in range(experts))
        self.chosen = list(range(experts))
        if rank_dependent:
            import torch.distributed as dist

            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            self.chosen = [e for e in range(experts) if e % world == rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        if not self.touch_unused:
            for e in self.chosen:
                out = out + weights[..., e:e + 1] * self.experts[e](x)
            return out
        # In expert order, run or touched: the gradients' order (ZeRO-1/2's bucket order) is the same on every rank.
        for e, expert in enumerate(self.experts):
            if e in self.chosen:
                out = out + weights[..., e:e + 1] * expert(x)
            else:
                out = out + sum(0 * p.sum() for p in expert.parameters())
        return out


class MoELayer(nn.Module):
    def __init__(self, hidden: int, experts: int, inner: int, rank_dependent: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoEBlock(hidden, experts, inner, rank_dependent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoEModel(nn.Module):
    """Layers of a LayerNorm and an MoE block: 3 + 3 x experts trainable tensors per layer, hidden 16.

    Tiny tensors, so a step is dominated by per-tensor overhead: the case where safe_zero's per-hook code shows.
    """

    def __init__(self, tensors: int, rank_dependent: bool = False, hidden: int = 16, inner: int = 32) -> None:
        super().__init__()
        experts = 8 if tensors < 5000 else 32
        layers = max(1, round(tensors / (3 + 3 * experts)))
        self.layers = nn.ModuleList(MoELayer(hidden, experts, inner, rank_dependent) for _ in range(layers))
        self.hidden = hidden
        self.shape = f"{layers} layers x (LayerNorm + router + {experts} experts x 3), hidden {hidden}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()

    def example(self) -> torch.Tensor:
        return torch.randn(8, self.hidden)


class Block(nn.Module):
    """A pre-norm transformer block: 2 LayerNorms, q/k/v/o projections and a 2-layer MLP, all with bias: 16 tensors."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        attention = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.o(attention @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class Transformer(nn.Module):
    """Transformer-shaped: blocks of 16 tensors and a final LayerNorm, hidden 16 (tiny tensors, many of them)."""

    def __init__(self, tensors: int, hidden: int = 16) -> None:
        super().__init__()
        blocks = max(1, round((tensors - 2) / 16))
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(hidden)
        self.hidden = hidden
        self.shape = f"{blocks} blocks x (2 LayerNorms + q/k/v/o + MLP) + LayerNorm, hidden {hidden}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x).pow(2).mean()

    def example(self) -> torch.Tensor:
        return torch.randn(2, 4, self.hidden)


#: The models the benchmark bodies take by name; ``tensors`` sizes the scaled ones (their trainable tensor count).
class SkippableTower(nn.Module):
    """``Wide`` fed by a vision tower (2 x Linear(256, 256)) that runs only where the step's input carries an image;
    counts the tower's forwards on this rank."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(hidden, hidden), nn.Linear(hidden, hidden))
        self.body = Wide(hidden)
        self.tower_forwards = 0

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        if image is not None:
            self.tower_forwards += 1
            x = x + self.tower(image)
        return self.body(x)


#: Per step, the ranks whose input carries an image (``skipping_tower_collectives``): every rank in the recorded
#: step, then rank 1 skips the tower in every other step.
TOWER_STEPS = ({0, 1}, {0}, {0, 1}, {0})


def skipping_tower_collectives(safe: bool, steps: tuple[set[int], ...] = TOWER_STEPS) -> dict[str, Any]:
    """Per step: this rank's collectives (as ``collectives_per_step``) and the tower's forwards on it, and what the
    session reports kept gathered, for ``SkippableTower`` at ZeRO-3 where ``steps`` say which ranks carry an image."""
    import torch.distributed as dist

    torch.manual_seed(0)
    module = SkippableTower()
    engine = _engine(module, 3, safe=safe)
    x, image = torch.randn(8, 256).to(torch.bfloat16), torch.randn(8, 256).to(torch.bfloat16)
    rank, per_step, forwards = dist.get_rank(), [], []
    with _counting_collectives() as counts:
        progress = getattr(getattr(engine, "_safe_zero", None), "uneven", None)
        if progress is not None and progress.progress is not None:
            progress.progress.store = _CountingStore(progress.progress.store, counts)
        for carriers in steps:
            counts.clear()
            before = module.tower_forwards
            loss = engine(x, image if rank in carriers else None)
            engine.backward(loss)
            engine.step()
            per_step.append(dict(counts))
            forwards.append(module.tower_forwards - before)
    session = getattr(engine, "safe_zero_session", None)
    kept = [line for line in (session.report.get("gradless_params", []) if session else []) if "kept" in line]
    return {"collectives": per_step, "tower_forwards": forwards, "kept": kept}


MODELS = {
    "wide": lambda tensors: Wide(),
    "with_empty": lambda tensors: WithEmpty(k=tensors),  # ``tensors``: K all-zero-sized submodules
    "moe": lambda tensors: MoEModel(tensors),
    "moe_rank_dependent": lambda tensors: MoEModel(tensors, rank_dependent=True),
    "transformer": lambda tensors: Transformer(tensors),
}


def build(model: str = "wide", tensors: int = 0) -> nn.Module:
    """``model`` from seed 0."""
    torch.manual_seed(0)
    return MODELS[model](tensors)


def touch_unused(module: nn.Module) -> nn.Module:
    """``module`` with every MoE block touching the experts its rank does not run (``MoEBlock.touch_unused``)."""
    for block in module.modules():
        if isinstance(block, MoEBlock):
            block.touch_unused = True
    return module


def example_input(module: nn.Module) -> torch.Tensor:
    """The model's input in bf16 (``Wide``: 8 x 256, drawn after the engines are built, as always)."""
    example = getattr(module, "example", None)
    return (example() if example is not None else torch.randn(8, 256)).to(torch.bfloat16)


def trainable_tensors(module: nn.Module) -> int:
    return sum(1 for p in module.parameters() if p.requires_grad)


def describe(model: str, tensors: int = 0) -> dict[str, Any]:
    """The model's shape and trainable tensor count (built on CPU, no engine): for the tests and the tables."""
    module = MODELS[model](tensors)
    described = {"shape": getattr(module, "shape", "4 x Linear(256, 256)"), "tensors": trainable_tensors(module),
                 "elements": sum(p.numel() for p in module.parameters() if p.requires_grad)}
    blocks = [m for m in module.modules() if isinstance(m, MoEBlock)]
    if blocks:  # the experts this rank runs (on a rank of a pool: rank-dependent where the model is)
        described["experts_run"] = blocks[0].chosen
        described["moe_blocks"] = len(blocks)
    return described


#: The scaled models' ZeRO-3 setting, for stock and safe_zero engines alike: once its trace is complete, DeepSpeed's
#: coordinator scans the modules ahead of each one it releases until ``stage3_max_reuse_distance`` elements (default
#: 1e9) have passed, and the scaled models' modules are tiny, so every release scans to the end of the model: a step
#: quadratic in the module count (the 5,000-tensor transformer's second step: 113 s stock, against 2-9 s for the
#: others). 0 releases a module's parameters as it ends, which these models, using each module once, do anyway.
SCALED_ZERO3 = {"stage3_max_reuse_distance": 0}


def _config(stage: int, options: dict[str, Any] | None = None, scaled: bool = False) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  **(SCALED_ZERO3 if scaled else {})},
            **({"safe_zero": options} if options else {})}


def _engine(model: nn.Module, stage: int, safe: bool | dict[str, Any]) -> Any:
    """A stock (``False``) or safe_zero engine (``True``, or a dict: its ``"safe_zero"`` block)."""
    import deepspeed

    import safe_zero

    init = safe_zero.initialize if safe is not False else deepspeed.initialize
    if safe is False and stage == 3:
        # What a stock user does for an experts ModuleList (safe_zero detects it): gather the MoE block whole.
        from deepspeed.utils import set_z3_leaf_module

        for module in model.modules():
            if isinstance(getattr(module, "experts", None), nn.ModuleList):
                set_z3_leaf_module(module, True)
    options = safe if isinstance(safe, dict) else None
    config = _config(stage, options, scaled=not isinstance(model, (Wide, WithEmpty)))
    with _summarized_tensor_reprs():
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=config)
    return engine


@contextlib.contextmanager
def _summarized_tensor_reprs() -> Iterator[None]:
    """DeepSpeed's ZeRO-3 optimizer formats its arguments into a debug message it then does not print (0.19.8
    stage3.py:214, ``{locals()}``), the values of every parameter of a model not built under ``zero.Init`` included:
    66 s per engine for the 20,000-tensor ``moe``. Summarized reprs (one element a side) cut that to about 5 s, for
    stock and safe_zero engines alike; the steps are not affected."""
    torch.set_printoptions(threshold=1, edgeitems=1)
    try:
        yield
    finally:
        torch.set_printoptions(profile="default")


#: An engine kind for :func:`stepped_seconds`: stock DeepSpeed on the model with :func:`touch_unused`, stock made
#: right by hand where ranks run other experts.
TOUCHED = "touched"


def stepped_seconds(stage: int, rounds: int = 60, warmup: int = 3, engines: tuple[Any, ...] = (False, False, True),
                    built_first: int = 0, model: str = "wide", tensors: int = 0) -> list[tuple[float, ...]]:
    """Per round, the seconds of one training step of ``model`` (``MODELS``) on each of ``engines``, in their order.

    ``engines``: ``False`` a stock engine, :data:`TOUCHED` a stock engine on the model with :func:`touch_unused`,
    ``True`` a safe_zero engine, a dict a safe_zero engine with that ``"safe_zero"`` block. The default gives, from
    the same rounds, safe_zero against stock and the harness's noise floor, stock against stock: a drift in the
    machine's load between them cannot pass for safe_zero's cost. Every engine lives in this process from the same
    seed, so a round shares the machine's state at that moment; the engines step in every order in turn, so each goes
    first, last and after each other one equally often (runs of few rounds start elsewhere in the orders, by
    ``built_first``). They are built from ``engines[built_first]`` on, wrapping round (where its buffers land depends
    on it, by several percent for a whole run): run every ``built_first``, several times. Each timed step starts
    after a full garbage collection, so Python's periodic full collections (at 20,000 tensors a few hundred
    milliseconds, every few steps) stay out of the rounds.
    """
    import torch.distributed as dist

    with _threads_for(model):
        built: dict[int, Any] = {}
        for which in ((built_first + k) % len(engines) for k in range(len(engines))):
            module = build(model, tensors)
            kind = engines[which]
            built[which] = _engine(touch_unused(module) if kind == TOUCHED else module, stage,
                                   False if kind == TOUCHED else kind)
        x = example_input(module)
        orders = list(itertools.permutations(range(len(engines))))

        def timed_step(which: int) -> float:
            gc.collect()
            dist.barrier()
            start = time.perf_counter()
            _step(built[which], x)
            return time.perf_counter() - start

        for _ in range(warmup):
            for which in range(len(engines)):
                timed_step(which)
        times = []
        for i in range(rounds):
            got = {which: timed_step(which) for which in orders[(i + built_first * rounds) % len(orders)]}
            times.append(tuple(got[which] for which in range(len(engines))))
        return times


@contextlib.contextmanager
def _threads_for(model: str) -> Iterator[None]:
    """The scaled models run with one intra-op thread per rank (2 ranks share 2 cores, and their tensors are tiny);
    ``Wide`` (and ``WithEmpty``) keep torch's default, as its rows always had."""
    if model in ("wide", "with_empty"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _step(engine: Any, x: torch.Tensor) -> None:
    loss = engine(x)
    engine.backward(loss)
    engine.step()


COLLECTIVES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_gather_base",
               "all_gather_coalesced", "broadcast", "all_to_all_single")


def _payload(args: tuple, kwargs: dict) -> int:
    """Bytes of a collective's first tensor argument (a list of tensors: all of them): what this rank sends."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
            return sum(t.numel() * t.element_size() for t in value)
    return 0


@contextlib.contextmanager
def _counting_collectives() -> Iterator[dict[str, int]]:
    """Counts, in the yielded dict, each collective DeepSpeed's comm backend issues, and ``<name>_bytes``: the bytes
    of its first tensor argument (an all_gather's output list, an all_reduce's or broadcast's tensor)."""
    from deepspeed.comm import comm

    counts: dict[str, int] = {}

    def counting(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            counts[f"{name}_bytes"] = counts.get(f"{name}_bytes", 0) + _payload(args, kwargs)
            return fn(*args, **kwargs)
        return wrapper

    names = [name for name in COLLECTIVES if hasattr(comm.cdb, name)]
    for name in names:
        setattr(comm.cdb, name, counting(name, getattr(comm.cdb, name)))
    try:
        yield counts
    finally:
        for name in names:
            delattr(comm.cdb, name)


class _CountingStore:
    """The store an engine posts its micro-steps to (``safe_zero.rank_progress``), counting each call in ``counts``
    as ``store_<method>``."""

    def __init__(self, store: Any, counts: dict[str, int]) -> None:
        self.store, self.counts = store, counts

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> Any:
            self.counts[f"store_{name}"] = self.counts.get(f"store_{name}", 0) + 1
            return getattr(self.store, name)(*args)
        return call


def collectives_per_step(stage: int, safe: bool, steps: int = 3, model: str = "wide",
                         tensors: int = 0) -> list[dict[str, int]]:
    """Per step: calls of each collective DeepSpeed's comm backend issues on ``model`` (``Wide``: every rank uses
    every parameter), and the bytes of each kind (``<name>_bytes``), to size any collective safe_zero adds; and the
    calls on the process group's store (``store_<method>``)."""
    with _threads_for(model):
        module = build(model, tensors)
        engine = _engine(module, stage, safe=safe)
        x = example_input(module)
        per_step = []
        with _counting_collectives() as counts:
            progress = getattr(getattr(engine, "_safe_zero", None), "uneven", None)
            if progress is not None and progress.progress is not None:
                progress.progress.store = _CountingStore(progress.progress.store, counts)
            for _ in range(steps):
                counts.clear()
                _step(engine, x)
                per_step.append(dict(counts))
        return per_step
