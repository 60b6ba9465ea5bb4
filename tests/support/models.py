"""Tiny models and configs shared by the tests: each reproduces one defect in a few parameters."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from safe_zero.probes import DropGrad, ZeroSized  # noqa: F401  (ZeroSized: the tests import it from here)


class Gradless(nn.Module):
    """A trainable parameter whose gradient stays ``None`` after backward (FP-Quant's ``dqweight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.dqweight = nn.Parameter(torch.full((4, 8), 0.125))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DropGrad.apply(self.dense(x), self.dqweight).pow(2).mean()


class Control(nn.Module):
    """No zero-sized and no grad-less parameters: stock DeepSpeed trains it."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.dense(x))).pow(2).mean()


class _QuantLinear(nn.Module):
    """FP-Quant's layout: sized bf16 tensors beside a trainable ``(0,)`` float32 placeholder."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        linear = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(linear.bias.detach().to(torch.bfloat16))
        # Registered between two sized tensors, so it sits inside a ZeRO partition, not on its edge.
        self.weight = nn.Parameter(torch.zeros(0))
        self.qweight = nn.Parameter(linear.weight.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.qweight, self.bias)


class FPQuantLike(nn.Module):
    """``Control`` rebuilt from quantized-style layers: at world size 2 each rank's partition holds a placeholder."""

    def __init__(self) -> None:
        super().__init__()
        self.q1 = _QuantLinear(8, 8)
        self.q2 = _QuantLinear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q2(torch.relu(self.q1(x))).pow(2).mean()


def cpu_fused_adam() -> type:
    """A DeepSpeed ``FusedAdam`` (the type check that routes bf16 stage 0 to the fused ``FP16_Optimizer``) for CPU.

    The real FusedAdam JIT-builds a kernel at construction; the wrappers under test only need an
    optimizer over their flat fp32 groups, so this one takes a plain SGD step.
    """
    from deepspeed.ops.adam import FusedAdam

    class CpuFusedAdam(FusedAdam):
        def __init__(self, params: Any, lr: float = 1e-2) -> None:
            torch.optim.Optimizer.__init__(self, params, {"lr": lr})
            self.set_grad_none = True

        @torch.no_grad()
        def step(self, closure: Any = None, **_: Any) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.to(p.dtype), alpha=-group["lr"])

    return CpuFusedAdam


def ds_config(stage: int, *, dtype: str = "bf16", batch: int = 2, world_size: int | None = None, **zero: Any) -> dict:
    """A DeepSpeed config for ``stage`` with torch Adam (no compiled ops needed on CPU).

    Without ``world_size`` DeepSpeed derives the global batch from the ranks it finds.
    """
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **zero},
        "steps_per_print": 10**9,
    }
    if world_size is not None:
        config["train_batch_size"] = batch * world_size
    if dtype in ("bf16", "fp16"):
        config[dtype] = {"enabled": True}
    return copy.deepcopy(config)


def batches(steps: int, *, batch: int = 2, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    """The same inputs on every rank and every run, so losses compare bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 8, generator=g).to(dtype) for _ in range(steps)]


def train(engine: Any, steps: int, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> list[float]:
    losses = []
    for x in batches(steps, dtype=dtype, seed=seed):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def build(model_cls: type, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return model_cls()


#: ``torch.nn.functional.grouped_mm``, which :class:`OddExperts`' forward calls, is in torch from 2.10 (2.8 and 2.9
#: have the private ``torch._grouped_mm`` only, 2.4-2.7 neither).
HAS_GROUPED_MM = hasattr(torch.nn.functional, "grouped_mm")
NO_GROUPED_MM = "needs torch.nn.functional.grouped_mm (torch >= 2.10), which OddExperts' forward calls"


def skip_without_grouped_mm() -> None:
    """Skip a test that runs :class:`OddExperts`' forward where torch has no ``F.grouped_mm``."""
    import pytest

    if not HAS_GROUPED_MM:
        pytest.skip(NO_GROUPED_MM)


class OddExperts(nn.Module):
    """An odd-numel parameter ahead of a 3-D expert weight marked grouped_mm (the hand-made misaligned layout).

    ``odd`` is 3 bf16 elements (6 bytes), so in a flat buffer ``experts`` starts 6 bytes off the 16-byte grid.
    The forward calls ``F.grouped_mm`` on it, one token per expert (:func:`skip_without_grouped_mm`).
    """

    def __init__(self) -> None:
        super().__init__()
        import safe_zero

        self.odd = nn.Parameter(torch.randn(3) * 0.1)
        self.experts = safe_zero.mark_grouped_mm(nn.Parameter(torch.randn(4, 8, 8) * 0.3))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([x, -x]) + self.odd.sum()
        offs = torch.arange(1, 5, dtype=torch.int32, device=x.device)
        h = torch.nn.functional.grouped_mm(tokens.to(self.experts.dtype), self.experts, offs=offs)
        return self.out(torch.relu(h)).float().pow(2).mean()


def grouped_mm_transformers() -> bool:
    """Whether Transformers' MoE models have grouped_mm experts: :class:`TinyGptOss` and the ``_TinyCausalMoE``
    models are its own modeling code with fused 3-D expert weights run through ``transformers.integrations.moe``
    (Transformers 5). Older releases (the 4.50 floor) build experts as separate modules, which need no alignment,
    and have no GPT-OSS before 4.55."""
    return (importlib.util.find_spec("transformers") is not None
            and importlib.util.find_spec("transformers.integrations.moe") is not None)


def skip_without_grouped_mm_transformers() -> None:
    """Skip a test of :func:`grouped_mm_transformers`' models where the installed Transformers has none."""
    import pytest

    if not grouped_mm_transformers():
        pytest.skip("needs Transformers' grouped_mm experts (transformers.integrations.moe, Transformers 5)")


class TinyGptOss(nn.Module):
    """A 1-layer GPT-OSS from a ``GptOssConfig`` (hidden 64, 4 experts, expert intermediate 32), fed by ``train``.

    Its 2-element attention sinks and 4-element router bias put the grouped_mm expert weights off the
    16-byte grid in a flat buffer (stock bf16 ZeRO-2: data_ptr() % 16 of 12, 12, 8, 8). ``forward`` turns the float
    batch into token ids.
    """

    VOCAB = 128

    def __init__(self) -> None:
        super().__init__()
        from transformers import GptOssConfig, GptOssForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the tiny RoPE settings trip a YaRN warning that does not matter here
        config = GptOssConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=32, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                              vocab_size=self.VOCAB, max_position_embeddings=64)
        self.lm = GptOssForCausalLM(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.float().abs() * 37).long() % self.VOCAB
        return self.lm(input_ids=ids, labels=ids).loss


class ExpertBlock(nn.Module):
    """An MoE block with separate expert modules, as remote-code MoE models write it.

    The router is frozen and routes on the input (top-1), and an expert no token was routed to is not
    called, so which experts get a gradient depends on each rank's data.
    """

    EXPERTS = 4

    def __init__(self, out_features: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(8, self.EXPERTS, bias=False)
        self.router.requires_grad_(False)
        with torch.no_grad():  # routes on the first EXPERTS input features: a token goes where it is largest
            self.router.weight.copy_(torch.eye(self.EXPERTS, 8))
        self.experts = nn.ModuleList(nn.Linear(8, out_features) for _ in range(self.EXPERTS))

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = h.new_zeros(h.shape[0], self.experts[0].out_features)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]))
        return out


class ExpertMoE(nn.Module):
    """A regression model around one :class:`ExpertBlock`; ``expert_batch`` builds tokens for chosen experts."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.moe = ExpertBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return (self.head(torch.relu(self.moe(x, h) + h)) - y).pow(2).mean()


class RootExperts(ExpertBlock):
    """An MoE layer trained as the whole model (a router probe, a small custom MoE head): its ``experts``
    ``nn.ModuleList`` hangs off the root, so there is no block below the root to gather whole."""

    def __init__(self) -> None:
        super().__init__(out_features=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x, x) - y).pow(2).mean()


class CheckpointedMoE(ExpertMoE):
    """:class:`ExpertMoE` with its MoE block under reentrant activation checkpointing: the block's backward
    runs as a nested backward of its own (another autograd graph task) inside the model's."""

    REENTRANT = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        moe = checkpoint(self.moe, x, h, use_reentrant=self.REENTRANT)
        return (self.head(torch.relu(moe + h)) - y).pow(2).mean()


class LateCheckpointedMoE(CheckpointedMoE):
    """:class:`CheckpointedMoE` that turns reentrant checkpointing on after its first forward."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.forwards = getattr(self, "forwards", 0) + 1
        return super().forward(x, y) if self.forwards > 1 else ExpertMoE.forward(self, x, y)


class NonReentrantCheckpointedMoE(CheckpointedMoE):
    """:class:`CheckpointedMoE` with non-reentrant checkpointing: one graph task, recomputed on unpack."""

    REENTRANT = False


def expert_batch(experts: list[int], seed: int, tokens_per_expert: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens routed to ``experts`` by :class:`ExpertMoE`'s router, and regression targets."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for e in experts:
        for _ in range(tokens_per_expert):
            x = torch.randn(8, generator=g) * 0.5
            x[e] = 3.0 + torch.rand(1, generator=g).item()
            rows.append(x)
    x = torch.stack(rows)
    return x, torch.randn(len(rows), 1, generator=g)


class OptionalTower(nn.Module):
    """A model whose vision tower runs only for samples that carry an image (``image`` is ``None`` otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self._before_tower()
        self.tower = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def _before_tower(self) -> None:
        """Where a variant registers a module before the tower (the lockstep orders by ``named_modules``)."""

    def _features(self, x: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return h + self.tower(image) if image is not None else h

    def forward(self, x: torch.Tensor, y: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        return (self.head(self._features(x, image)) - y).pow(2).mean()


class CheckpointedTower(OptionalTower):
    """``OptionalTower`` whose tower runs under non-reentrant activation checkpointing: its forward again inside the
    backward."""

    def _features(self, x: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if image is None:
            return h
        return h + torch.utils.checkpoint.checkpoint(self.tower, image, use_reentrant=False)


class FrozenTower(OptionalTower):
    """``OptionalTower`` with its tower frozen (a fine-tune of the language side): gathered, never reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.tower.requires_grad_(False)


class VideoTower(OptionalTower):
    """``OptionalTower`` that also takes a video, through the same tower (Qwen-VL's vision tower runs once per
    modality): a rank with an image and a video runs the tower twice, one with either once, one with neither never."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, image: torch.Tensor | None = None,
                video: torch.Tensor | None = None) -> torch.Tensor:
        h = self._features(x, image)
        if video is not None:
            h = h + self.tower(video)
        return (self.head(h) - y).pow(2).mean()


class _PatchEmbed(nn.Module):
    """Reads its child's weight before calling it, as transformers' Qwen2-VL, SigLIP and Pixtral patch embeddings do
    (``target_dtype = self.proj.weight.dtype``): no parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.proj(image.to(dtype=self.proj.weight.dtype))


class ReadingTower(OptionalTower):
    """``OptionalTower`` whose tower starts with ``_PatchEmbed``: the rank with an image reads ``tower.0.proj.weight``
    before entering any module with parameters of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(_PatchEmbed(), nn.Tanh(), nn.Linear(8, 8))


class ForeignReadingTower(OptionalTower):
    """``OptionalTower`` whose image path also reads a weight of a module every rank runs, outside that module
    (``inp.bias``): a parameter read outside its module, on the ranks with an image only."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if image is not None:
            h = h + self.tower(image) * self.inp.bias
        return (self.head(h) - y).pow(2).mean()


class TiedTower(OptionalTower):
    """``OptionalTower`` whose last tower layer shares its weight with ``inp``, a module every rank runs: a weight
    shared by a module some ranks skip and one they all run."""

    def __init__(self) -> None:
        super().__init__()
        self.tower[2].weight = self.inp.weight


class FunctionalReadingTower(OptionalTower):
    """An optional tower, and a weight every rank reads without entering its module (``F.linear(h, self.mix.weight)``,
    as inkling2's causal convolution reads ``conv1d.weight``), registered before the tower: the text-only ranks read
    it while the others are still in the tower."""

    def _before_tower(self) -> None:
        self.mix = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.nn.functional.linear(self._features(x, image), self.mix.weight)
        return (self.head(h) - y).pow(2).mean()


class _ReadsItsChild(nn.Module):
    """Has parameters of its own (its entry is agreed on) and reads ``conv.weight`` without entering ``conv``, as
    Qwen3.5's gated delta net (``A_log``, ``dt_bias``) reads ``conv1d.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.conv = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(torch.nn.functional.linear(h * self.scale, self.conv.weight)))


class WholeReadingTower(OptionalTower):
    """An optional tower, and a block registered before it that reads its child's weight without entering the child
    (MiniCPM-V 4.6's text model): the text-only ranks reach the block while the others are in the tower, so the
    lockstep gathers it whole for them and the read finds the weight gathered."""

    def _before_tower(self) -> None:
        self.block = _ReadsItsChild()

    def forward(self, x: torch.Tensor, y: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        return (self.head(self.block(self._features(x, image))) - y).pow(2).mean()


class FrozenEmpty(nn.Module):
    """A frozen zero-element layer, frozen from birth: ``zero.Init`` already sees it frozen when it partitions (and
    quantizes) it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, 8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class _Shift(nn.Module):
    """A linear layer whose learned shift is added only when asked: entered on every rank, ``shift`` used on some."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(8, 8)
        self.shift = nn.Parameter(torch.zeros(8))

    def forward(self, h: torch.Tensor, shifted: bool) -> torch.Tensor:
        h = self.scale(h)
        return h + self.shift if shifted else h


class _MovingScale(nn.Module):
    """Scales its input before its child layer or its output after it: under ZeRO-3 the gradient of ``scale``
    then arrives after the child's gathers in a backward, or before them."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, h: torch.Tensor, early: bool) -> torch.Tensor:
        return self.child(h * self.scale) if early else self.child(h) * self.scale


class _RegressionAround(nn.Module):
    """A regression model around one ``BODY`` module that takes a per-batch flag."""

    BODY: type[nn.Module]

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.body = self.BODY()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, flag: bool) -> torch.Tensor:
        return (self.head(self.body(torch.relu(self.inp(x)), flag)) - y).pow(2).mean()


class SometimesShifted(_RegressionAround):
    """Every rank runs every module, but ``body.shift`` gets a gradient only on ranks whose batch asks for it."""

    BODY = _Shift


class MovingScale(_RegressionAround):
    """``body.scale``'s gradient arrives before or after ``body.child``'s gathers, as the batch's flag says."""

    BODY = _MovingScale


class _TinyCausalMoE(nn.Module):
    """A tiny causal LM from Transformers' own modeling code with grouped_mm experts, fed by ``train``."""

    VOCAB = 128

    def __init__(self) -> None:
        super().__init__()
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        config = getattr(transformers, self.CONFIG)(vocab_size=self.VOCAB, max_position_embeddings=64, **self.SIZES)
        self.lm = getattr(transformers, self.MODEL)(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.float().abs() * 37).long() % self.VOCAB
        return self.lm(input_ids=ids, labels=ids).loss


class TinyDeepseekV3(_TinyCausalMoE):
    """DeepSeek-V3: hidden 64, 2 MoE layers, 4 routed experts of width 32, one shared expert (issue 15's model)."""

    CONFIG, MODEL = "DeepseekV3Config", "DeepseekV3ForCausalLM"
    SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
                 num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16,
                 q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


class TinyQwen3Moe(_TinyCausalMoE):
    """Qwen3-MoE: hidden 64, 1 layer, 4 experts of width 32."""

    CONFIG, MODEL = "Qwen3MoeConfig", "Qwen3MoeForCausalLM"
    SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2)


class TinyOlmoe(_TinyCausalMoE):
    """OLMoE: hidden 64, 1 layer, 4 experts of width 32."""

    CONFIG, MODEL = "OlmoeConfig", "OlmoeForCausalLM"
    SIZES = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
