"""One zoo row: a transformers architecture trained data-parallel on rank-dependent batches (stock DeepSpeed or
safe_zero, ZeRO-2 or ZeRO-3, 2 or 3 gloo ranks), and the ground truth it is held to: single-process AdamW on the
global batch.

Every rank gets its own token ids; for a vision-language model (an audio LM: an audio clip) the data ``PATTERNS`` say
which ranks carry an image in which step: by default ("fixed") the even ranks in every step and the odd ranks text
only, the everyday mixed-data fine-tune. The reference averages the ranks' losses, so a parameter a rank did not use
contributes a zero gradient there (DDP's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tests.zoo import remote
from tests.zoo.architectures import MULTIMODAL, Architecture, batch, build, takes_video

#: The kind of the remote-code MoE causal LMs (``tests/zoo/remote``): experts as an ``nn.ModuleList`` of modules a rank
#: enters only for the tokens routed to them, loaded through ``auto_map`` as ``trust_remote_code`` does.
REMOTE = "remote_moe_lm"


#: Before a remote-code model's folder name: "deepseek_v3" is an in-library model type too.
_REMOTE_PREFIX = "remote_"


def remote_architectures() -> list[Architecture]:
    return [Architecture(_REMOTE_PREFIX + name, REMOTE) for name in remote.REMOTE_MODELS]


def build_model(arch: Architecture) -> torch.nn.Module:
    return remote.load(arch.model_type.removeprefix(_REMOTE_PREFIX)) if arch.kind == REMOTE else build(arch)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT's LoRA (rank 2) on the attention's ``q_proj``/``v_proj``, everything else frozen (the tower too, which
    still has to be gathered wherever it runs), as a LoRA fine-tune of a VLM's language model is."""
    import peft

    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))

STEPS = 3
LR = 1e-3
#: Adam's epsilon, above its default: a gradient that is zero up to rounding (a key projection's bias under softmax)
#: would otherwise take a full step of either sign, and a row differ by ``LR`` for no reason of its own.
EPS = 1e-6
#: The largest parameter difference after ``STEPS`` that counts as DDP-exact (fp32, reductions in another order).
TOLERANCE = 1e-4


#: Which ranks carry the modality (an image; an audio clip for an audio LM) in which step (issue 48):
#: - "fixed": the even ranks in every step, the odd ones text only from the first step on (the zoo's first pattern);
#: - "late": every rank in the first step (the recorded one), then rank 1 text only;
#: - "rotating": 4 steps: every rank, rank 0 only, no rank, the last rank only;
#: - "image+video": every rank an image in every step, the even ranks a video too (the tower runs twice there;
#:   families that take Qwen-VL's videos, ``takes_video``).
PATTERNS = ("fixed", "late", "rotating", "image+video")


def patterns(arch: Architecture) -> tuple[str, ...]:
    """The data patterns a family's rows run: none but "fixed" without a modality, "image+video" where it takes one."""
    if arch.kind not in MULTIMODAL:
        return ("fixed",)
    return PATTERNS if takes_video(arch) else PATTERNS[:-1]


def steps(pattern: str = "fixed") -> int:
    return 4 if pattern == "rotating" else STEPS


def has_image(arch: Architecture, rank: int, step: int = 0, pattern: str = "fixed", world_size: int = 2) -> bool:
    if arch.kind not in MULTIMODAL:
        return False
    if pattern == "fixed":
        return rank % 2 == 0
    if pattern == "late":
        return step == 0 or rank != 1
    if pattern == "rotating":
        return (True, rank == 0, False, rank == world_size - 1)[step]
    if pattern == "image+video":
        return True
    raise ValueError(f"unknown data pattern {pattern!r}; one of {PATTERNS}")


def has_video(arch: Architecture, rank: int, pattern: str = "fixed") -> bool:
    return pattern == "image+video" and rank % 2 == 0


def _batches(arch: Architecture, model: torch.nn.Module, rank: int, pattern: str = "fixed", seed: int = 0,
             world_size: int = 2) -> list[dict[str, torch.Tensor]]:
    """Made before ZeRO partitions the model: a family's inputs may be sized from its unpartitioned modules."""
    if arch.kind == REMOTE:
        return [remote.batch(arch.model_type.removeprefix(_REMOTE_PREFIX), rank, step) for step in range(STEPS)]
    return [batch(arch, model, rank, step, has_image(arch, rank, step, pattern, world_size), seed=seed,
                  video=has_video(arch, rank, pattern)) for step in range(steps(pattern))]


def ds_config(stage: int, world_size: int, persistence: int | None = None) -> dict[str, Any]:
    """``persistence``: ZeRO-3's ``stage3_param_persistence_threshold``; DeepSpeed's default (1e5) keeps every
    parameter of a tiny model gathered, 0 partitions them all, as parameters are at real sizes."""
    zero: dict[str, Any] = {"stage": stage}
    if persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    return {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0, "torch_adam": True}},
            "gradient_clipping": 1.0, "zero_optimization": zero, "steps_per_print": 10**9}


def train(model_type: str, kind: str, stage: int, safe: bool, world_size: int, pattern: str = "fixed", seed: int = 0,
          persistence: int | None = None, lora: bool = False) -> dict[str, Any]:
    """A rank body (``rig``): ``steps(pattern)`` steps; rank 0 returns the full parameters after them."""
    import deepspeed
    import torch.distributed as dist

    import safe_zero

    arch, rank = Architecture(model_type, kind), dist.get_rank()
    model = build_model(arch)
    batches = _batches(arch, model, rank, pattern, seed, world_size)
    model = with_lora(model) if lora else model
    init = safe_zero.initialize if safe else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                      config=ds_config(stage, world_size, persistence))
    losses = []
    for inputs in batches:
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()} if rank == 0 else {}
    report = dict(engine.safe_zero_session.report) if safe else {}
    engine.destroy()
    return {"params": state, "losses": losses, "report": report}


def reference(arch: Architecture, world_size: int, pattern: str = "fixed", seed: int = 0,
              lora: bool = False) -> dict[str, Any]:
    """Single-process fp32 AdamW + ``clip_grad_norm_`` on the mean of the ranks' losses."""
    model = build_model(arch)
    batches = [_batches(arch, model, rank, pattern, seed, world_size) for rank in range(world_size)]
    model = with_lora(model) if lora else model
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, eps=EPS, weight_decay=0.0)
    losses = []
    for step in range(steps(pattern)):
        optimizer.zero_grad()
        per_rank = [model(**batches[rank][step]).loss for rank in range(world_size)]
        torch.stack(per_rank).mean().backward()
        for p in trainable:  # ZeRO steps whole groups: a parameter no rank used gets a zero gradient, not None
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        losses.append([loss.item() for loss in per_rank])
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses}


@dataclass
class Outcome:
    """What one row did: ``"exact"`` (within ``TOLERANCE`` of the reference), ``"wrong"`` (trained, but not DDP's
    result), or ``"failed"`` (a rank raised, aborted or hung); ``detail`` is the difference or the first error line."""

    verdict: str
    difference: float | None = None
    detail: str = ""
    kept: str = ""

    def cell(self) -> str:
        if self.verdict == "failed":
            return "aborts" if self.detail.startswith("a rank aborted") else f"fails: {self.detail}"
        return f"{'DDP-exact' if self.verdict == 'exact' else 'WRONG'} ({self.difference:.1e})"


def max_difference(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert params.keys() == expected.keys(), sorted(params.keys() ^ expected.keys())
    return max(((params[n].float() - expected[n].float()).abs().max().item() for n in expected if expected[n].numel()),
               default=0.0)


def judge(results: list[dict[str, Any]], expected: dict[str, Any]) -> Outcome:
    difference = max_difference(results[0]["params"], expected["params"])
    for rank, result in enumerate(results):
        for step, loss in enumerate(result["losses"]):
            difference = max(difference, abs(loss - expected["losses"][step][rank]))
    kept = "; ".join(what for what in results[0]["report"].get("gradless_params", ()) if "kept gathered" in what)
    return Outcome("exact" if difference < TOLERANCE else "wrong", difference, kept=kept)


def first_line(error: BaseException) -> str:
    """The line of a rank failure a table can show: gloo's abort, or the first rank's exception."""
    text = str(error)
    if "died during job" in text:  # gloo aborts the process on a collective whose sizes do not match
        return "a rank aborted " + text[text.index("(exit codes"):].split(")")[0] + ")"
    for marker in ("Received data size doesn't match expected size", "Connection reset by peer", "timed out",
                   "did not finish"):
        if marker in text:
            return marker
    line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return line[:120]


def run_row(pools: Any, arch: Architecture, stage: int, safe: bool, world_size: int, expected: dict[str, Any],
            timeout: float = 180, pattern: str = "fixed", seed: int = 0, persistence: int | None = None,
            lora: bool = False) -> Outcome:
    """One row on ``pools`` (``rig.Pools``); a row that fails leaves its pool to be rebuilt. ``expected`` is
    ``reference(arch, world_size, pattern, seed)``."""
    from rig import RankFailure

    try:
        results = pools.run(world_size, train, model_type=arch.model_type, kind=arch.kind, stage=stage, safe=safe,
                            world_size=world_size, pattern=pattern, seed=seed, persistence=persistence, lora=lora,
                            timeout=timeout, grace=20)
    except (RankFailure, RuntimeError, TimeoutError) as error:
        return Outcome("failed", detail=first_line(error))
    return judge(results, expected)
