"""Rank bodies for ``benchmarks/run.py``: each runs on every rank of a CPU/gloo pool (safe_zero/ranks.py)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Iterator

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
MODELS = {
    "wide": lambda tensors: Wide(),
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
    """The model's shape and trainable tensor count (built on CPU, no engine): for the tables and the tests."""
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
    config = _config(stage, options, scaled=not isinstance(model, Wide))
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
    first, last and after each other one equally often. They are built from ``engines[built_first]`` on, wrapping
    round (where its buffers land depends on it, by several percent for a whole run): run every ``built_first``,
    several times. Each timed step starts after a full garbage collection, so Python's periodic full collections (at
    20,000 tensors a few hundred milliseconds, every few steps) stay out of the rounds.
    """
    import torch.distributed as dist

    with _threads_for(model):
        return _stepped_seconds(stage, rounds, warmup, engines, built_first, model, tensors, dist)


def _stepped_seconds(stage: int, rounds: int, warmup: int, engines: tuple[Any, ...], built_first: int,
                     model: str, tensors: int, dist: Any) -> list[tuple[float, ...]]:
    built: dict[int, Any] = {}
    for which in ((built_first + k) % len(engines) for k in range(len(engines))):
        module = build(model, tensors)
        kind = engines[which]
        if kind == TOUCHED:
            touch_unused(module)
        built[which] = _engine(module, stage, False if kind == TOUCHED else kind)
    return _rounds([(built[which], False) for which in range(len(engines))], example_input(module), rounds,
                   warmup, built_first, dist)


def switched_seconds(stage: int, rounds: int = 60, warmup: int = 3, built_first: int = 0, model: str = "wide",
                     tensors: int = 0) -> list[tuple[float, ...]]:
    """Per round, the seconds of one training step of one safe_zero engine of ``model`` with safe_zero switched off
    (:func:`switched_off`), switched off again, and on: ``stepped_seconds``' rounds with the three engines made one.

    Off, the engine runs DeepSpeed's own methods on the same buffers, so the ratio on/off is what safe_zero's code
    adds to a step, without the few percent by which where separately built engines' buffers land moves their steps,
    and off/off is the harness's noise floor. Only for models stock DeepSpeed trains right (every rank uses every
    parameter): there an off step is a stock step. ``built_first`` only moves where the rounds start in the orders,
    as in ``stepped_seconds``. The first warm-up step is on: the step in which the ranks agree.
    """
    import torch.distributed as dist

    with _threads_for(model):
        module = build(model, tensors)
        engine = _engine(module, stage, True)
        x = example_input(module)
        _step(engine, x)
        return _rounds([(engine, True), (engine, True), (engine, False)], x, rounds, warmup, built_first, dist)


def _rounds(steppers: list[tuple[Any, bool]], x: torch.Tensor, rounds: int, warmup: int, offset: int,
            dist: Any) -> list[tuple[float, ...]]:
    """Per round, the seconds of one step of each ``(engine, switched off)`` of ``steppers``, in their order; the
    rounds go through every order of them in turn, from ``offset * rounds`` on."""
    orders = list(itertools.permutations(range(len(steppers))))

    def timed_step(which: int) -> float:
        engine, off = steppers[which]
        with switched_off(engine) if off else contextlib.nullcontext():
            # A full collection traverses every object the engines hold (hundreds of milliseconds at 20,000 tensors,
            # once every few steps): done here, outside the timing, it cannot land in one engine's steps more than
            # another's.
            gc.collect()
            dist.barrier()
            start = time.perf_counter()
            _step(engine, x)
            return time.perf_counter() - start

    for _ in range(warmup):
        for which in range(len(steppers)):
            timed_step(which)
    times = []
    for i in range(rounds):
        # Runs of few rounds each start elsewhere in the orders, so that together they go through all of them.
        got = {which: timed_step(which) for which in orders[(i + offset * rounds) % len(orders)]}
        times.append(tuple(got[which] for which in range(len(steppers))))
    return times


@contextlib.contextmanager
def switched_off(engine: Any) -> Iterator[None]:
    """A safe_zero engine running DeepSpeed's own methods for the ``with`` block: every safe_zero override on its
    optimizer and, at ZeRO-3, its parameter manager and coordinator is bound to the DeepSpeed method it extends
    (``patching.pass_through``, as safe_zero does for a fix with nothing to do), and resumed after the block.

    For a model stock DeepSpeed trains right, a step in the block is a stock step on the engine's buffers (no
    safe_zero function runs in it, tests/benchmarks); between its steps safe_zero's state stays as the last step
    left it, and the next backward begins afresh as always."""
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    from safe_zero.fixes.gradless_params import SafeZeROOrderedDict
    from safe_zero.patching import is_override, pass_through, resume

    # The parameter dictionaries a recording forward left watching reads: DeepSpeed's class inside the block.
    watching = [m._parameters for m in engine.module.modules() if type(m._parameters) is SafeZeROOrderedDict]
    owners = [engine.optimizer]
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is not None:
        owners += [offload, offload.get_param_coordinator()]
    switched = []
    for owner in owners:
        idle = owner.__dict__.get("_safe_zero_idle", {})
        switched += [(owner, name, klass) for klass in type(owner).__mro__ for name, method in vars(klass).items()
                     if name != "__init__" and is_override(method) and klass not in idle.get(name, ())]
    for owner, name, klass in switched:
        pass_through(owner, name, klass)
    for params in watching:
        params.__class__ = ZeROOrderedDict
    try:
        yield
    finally:
        for params in watching:
            params.__class__ = SafeZeROOrderedDict
        for owner, name, klass in reversed(switched):
            resume(owner, name, klass)


@contextlib.contextmanager
def _threads_for(model: str) -> Iterator[None]:
    """The scaled models run with one intra-op thread per rank (2 ranks share 2 cores, and their tensors are tiny);
    ``Wide`` keeps torch's default, as its rows always had."""
    if model == "wide":
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


def _ours(filename: str) -> str | None:
    """``filename`` relative to the safe_zero package, or ``None`` when it is not safe_zero's."""
    import safe_zero

    root = os.path.dirname(os.path.abspath(safe_zero.__file__)) + os.sep
    return filename[len(root):] if filename.startswith(root) else None


def safe_zero_share(stage: int, steps: int = 30, warmup: int = 3, model: str = "wide", tensors: int = 0,
                    top: int = 12) -> dict[str, Any]:
    """Under cProfile, the share of a safe_zero step spent in safe_zero's own functions, and their calls per step.

    An upper bound on what safe_zero's Python adds (the profiler inflates Python calls, not kernels),
    and a count that does not depend on the machine's load. ``functions``: safe_zero's ``top`` functions by calls,
    each with its calls per step and its own time's share of the step.
    """
    with _threads_for(model):
        module, engine, x = _warmed(stage, model, tensors, warmup)
        return _profiled(engine, x, steps, trainable_tensors(module), top)


def _warmed(stage: int, model: str, tensors: int, warmup: int) -> tuple[nn.Module, Any, torch.Tensor]:
    """``model`` in a safe_zero engine that has taken ``warmup`` steps: the module, the engine, the input."""
    module = build(model, tensors)
    engine = _engine(module, stage, True)
    x = example_input(module)
    for _ in range(warmup):
        _step(engine, x)
    return module, engine, x


def _profiled(engine: Any, x: torch.Tensor, steps: int, tensors: int, top: int = 12) -> dict[str, Any]:
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        _step(engine, x)
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(v[2] for v in stats.values())
    ours = [(f"{path}:{k[2]}", v) for k, v in stats.items() if (path := _ours(k[0])) is not None]
    ours.sort(key=lambda item: (-item[1][1], item[0]))
    return {"share": sum(v[2] for _, v in ours) / total,
            "calls_per_step": sum(v[1] for _, v in ours) / steps,
            "profiled_ms_per_step": 1e3 * total / steps, "tensors": tensors, "steps": steps,
            "functions": [{"function": name, "calls_per_step": v[1] / steps, "share": v[2] / total}
                          for name, v in ours[:top]]}


#: Samples per second py-spy takes in ``sampled_share``: a 1,000-tensor row gets some 25,000 samples in 200 steps,
#: so a share near 1 % is known to about +-0.1 %.
SAMPLE_RATE = 400


def py_spy() -> str | None:
    """The py-spy executable (the ``bench`` extra installs it beside this Python), or ``None``."""
    return shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")


def sampled_share(stage: int, steps: int = 100, warmup: int = 3, model: str = "wide", tensors: int = 0,
                  rate: int = SAMPLE_RATE, off: bool = False) -> dict[str, Any]:
    """safe_zero's own share of a step, sampled (:func:`sampling`) while the engine takes ``steps`` steps (``off``:
    switched off, where nothing may be charged to safe_zero).

    A sample is safe_zero's where its innermost Python frame is in a file under safe_zero/: its own lines and the C
    functions they call, not the DeepSpeed methods it calls. A thread waiting (in a collective) is not sampled, so
    the share is of the time the rank computes. Returns :func:`attributed`'s counts, or ``error``."""
    import torch.distributed as dist

    with _threads_for(model):
        _, engine, x = _warmed(stage, model, tensors, warmup)
        with sampling(rate) as got:
            dist.barrier()
            with switched_off(engine) if off else contextlib.nullcontext():
                _sampled_steps(engine, x, steps if "error" not in got else 0)
            dist.barrier()
    if "error" in got:
        return got
    return {**attributed(got["raw"], _sampled_steps.__code__), "steps": steps, "rate": rate, "tensors": tensors}


@contextlib.contextmanager
def sampling(rate: int = SAMPLE_RATE) -> Iterator[dict[str, Any]]:
    """py-spy samples this process's Python stacks ``rate`` times a second during the block, from outside it: no
    hook runs per call, so a function of a few lines is not charged a profiler's per-call cost, as under cProfile.
    After the block the yielded dict holds py-spy's raw samples (``raw``, lines ``frame;...;frame count``), or
    ``error`` (set at once where py-spy is missing or cannot read the process)."""
    got: dict[str, Any] = {}
    spy = py_spy()
    if spy is None:
        got["error"] = "py-spy is not installed (pip install 'safe_zero[bench]')"
        yield got
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples.txt")
        sampler = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--rate", str(rate), "--format", "raw",
                                    "--full-filenames", "--output", out],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert sampler.stdout is not None
        said = []
        for line in sampler.stdout:  # "py-spy> Sampling process ..." once it reads this process; EOF if it cannot
            said.append(line)
            if line.startswith("py-spy> Sampling"):
                break
        else:
            sampler.wait(timeout=60)
            got["error"] = f"py-spy did not sample this process: {''.join(said).strip()[-400:]}"
        try:
            yield got
        finally:
            if "error" not in got:
                sampler.send_signal(signal.SIGINT)  # py-spy writes its samples as it stops
                log = sampler.stdout.read()
                sampler.wait(timeout=60)
                if os.path.exists(out):
                    with open(out) as f:
                        got["raw"] = f.read().splitlines()
                else:
                    got["error"] = f"py-spy wrote no samples: {log.strip()[-400:]}"
            sampler.stdout.close()


def _sampled_steps(engine: Any, x: torch.Tensor, steps: int) -> None:
    # The samples taken in this frame's calls are the step's: sampled_share counts those alone.
    for _ in range(steps):
        _step(engine, x)


def attributed(raw: Iterable[str], within: Any) -> dict[str, Any]:
    """Of py-spy's raw samples (:func:`sampling`; per stack ``frame;...;frame count``, outermost first, each frame
    ``name (file:line)``), those taken while a call of ``within`` (a code object) ran: how many, how many with a
    frame of safe_zero's innermost, and those by function (``path:name``, the path under safe_zero/)."""
    marker = f"{within.co_name} ({within.co_filename}:"
    samples, ours, functions = 0, 0, {}
    for line in raw:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if marker not in stack:
            continue
        n = int(count)
        samples += n
        innermost = stack.rsplit(";", 1)[-1]
        name, _, where = innermost.rpartition(" (")
        path = _ours(where.rsplit(":", 1)[0])
        if path is not None:
            ours += n
            function = f"{path}:{name.rsplit('.', 1)[-1]}"
            functions[function] = functions.get(function, 0) + n
    return {"samples": samples, "ours": ours, "functions": functions}


def _deep_size(obj: Any, seen: set[int]) -> int:
    """Bytes of ``obj`` and what it holds: containers, ints, strings, safe_zero's own objects and the tensors they
    made; a parameter (DeepSpeed holds it anyway) counts only as the reference to it."""
    if id(obj) in seen or isinstance(obj, (nn.Parameter, nn.Module, type)) or callable(obj):
        return 0
    if hasattr(obj, "__dict__") and not all(k is object or k.__module__.startswith("safe_zero")
                                            for k in type(obj).__mro__):
        return 0  # DeepSpeed's objects (the optimizer, the coordinator) and others: referenced, not held
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes() if obj.device.type == "cpu" else 0
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return size + sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return size + sum(_deep_size(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):  # safe_zero's own: the agreement, the order, the walk, the session
        return size + _deep_size(vars(obj), seen)
    return size


def safe_zero_state_bytes(engine: Any) -> int:
    """Bytes of the state safe_zero keeps on an engine: every ``_safe_zero_*`` attribute of the engine, its optimizer
    and (ZeRO-3) its parameter coordinator, deep (``_deep_size``): the agreement and its flags, the reduction order
    with its module clocks, the walk, the module clock, the module names."""
    owners = [engine, getattr(engine, "optimizer", None)]
    offload = getattr(owners[1], "parameter_offload", None)
    if offload is not None:
        owners.append(offload.get_param_coordinator())
    seen: set[int] = set()
    return sum(_deep_size(value, seen) for owner in owners if owner is not None
               for name, value in vars(owner).items() if name.startswith("_safe_zero"))


def scaled_costs(stage: int, model: str, tensors: int, safe: bool = True, steps: int = 3, profile_steps: int = 5,
                 top: int = 40) -> dict[str, Any]:
    """One engine of ``model``, ``steps`` steps counting collectives (``collectives_per_step``) and, for safe_zero,
    the memory its state holds, then (safe_zero) ``profile_steps`` steps under cProfile (``safe_zero_share``).

    Memory (``safe_zero_state_bytes``): sampled after initialize and, in each step, right before and after the
    epilogue DeepSpeed calls (``independent_gradient_partition_epilogue``): before it the backward's agreement or
    walk is live, after it the agreed reduction order. The peak of those samples is reported. The gathered hook
    orders are transient: ``collectives`` sizes them.
    """
    with _threads_for(model):
        module = build(model, tensors)
        engine = _engine(module, stage, safe)
        x = example_input(module)
        held = (lambda: safe_zero_state_bytes(engine)) if safe else (lambda: 0)
        points = {"after initialize": held()}
        optimizer = engine.optimizer
        epilogue = optimizer.independent_gradient_partition_epilogue
        step = [0]

        def sampled_epilogue(*args: Any, **kwargs: Any) -> Any:
            points[f"step {step[0] + 1}, before the epilogue"] = held()
            result = epilogue(*args, **kwargs)
            points[f"step {step[0] + 1}, after the epilogue"] = held()
            return result

        if safe:
            optimizer.independent_gradient_partition_epilogue = sampled_epilogue
        started = time.perf_counter()
        try:
            with _counting_collectives() as counts:
                per_step = []
                for step[0] in range(steps):
                    counts.clear()
                    _step(engine, x)
                    per_step.append(dict(counts))
        finally:
            if safe:
                del optimizer.independent_gradient_partition_epilogue
        points["after the last step"] = held()
        n = trainable_tensors(module)
        where = max(points, key=points.get)
        result = {"tensors": n, "collectives": per_step, "counted_steps_seconds": time.perf_counter() - started}
        if safe:
            result["memory"] = {"peak_bytes": points[where], "peak_at": where, "bytes_per_tensor": points[where] / n,
                                "points": points}
            if profile_steps:
                result["profile"] = _profiled(engine, x, profile_steps, n, top)
        return result


def all_gathers_per_step(k: int, steps: int = 3) -> list[int]:
    """All-gathers DeepSpeed's comm backend issues per ZeRO-3 step with safe_zero, K all-zero-sized submodules."""
    from deepspeed.comm import comm

    torch.manual_seed(0)
    engine = _engine(WithEmpty(k), 3, safe=True)
    names = ("all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced")
    count = [0]

    def counting(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in names:
        setattr(comm.cdb, name, counting(getattr(comm.cdb, name)))
    try:
        x = torch.randn(8, 256).to(torch.bfloat16)
        per_step = []
        for _ in range(steps):
            count[0] = 0
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            per_step.append(count[0])
    finally:
        for name in names:
            delattr(comm.cdb, name)
    return per_step


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


def collectives_per_step(stage: int, safe: bool, steps: int = 3, model: str = "wide",
                         tensors: int = 0) -> list[dict[str, int]]:
    """Per step: calls of each collective DeepSpeed's comm backend issues on ``model`` (``Wide``: every rank uses
    every parameter), and the bytes of each kind (``<name>_bytes``), to size any collective safe_zero adds."""
    with _threads_for(model):
        module = build(model, tensors)
        engine = _engine(module, stage, safe=safe)
        x = example_input(module)
        per_step = []
        with _counting_collectives() as counts:
            for _ in range(steps):
                counts.clear()
                _step(engine, x)
                per_step.append(dict(counts))
        return per_step
