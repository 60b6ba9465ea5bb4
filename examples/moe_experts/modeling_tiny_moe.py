"""A tiny causal LM written the way remote-code MoE models are (DeepSeek-V2/Kimi/MiniMax style).

Each MoE layer keeps its experts as separate modules in an ``nn.ModuleList`` and calls only the
experts that its tokens were routed to (top-1 here). Which experts run therefore depends on each
rank's data: under stock ZeRO-3 the ranks gather different experts and DeepSpeed stops with
``Detected a disagreement on list contents`` (or waits forever in a collective). safe_zero detects
the block (an ``experts`` ``ModuleList``) and gathers it whole as a ZeRO-3 leaf module, with no
configuration.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class TinyMoeConfig(PretrainedConfig):
    model_type = "tiny_moe"

    def __init__(self, vocab_size: int = 128, hidden_size: int = 32, intermediate_size: int = 64,
                 num_hidden_layers: int = 2, n_routed_experts: int = 8, **kwargs) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.n_routed_experts = n_routed_experts
        super().__init__(**kwargs)


class TinyMLP(nn.Module):
    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.up_proj(x)))


class TinyMoE(nn.Module):
    """Top-1 routed experts as separate modules; an expert with no token is skipped."""

    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(TinyMLP(config) for _ in range(config.n_routed_experts))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        weights = self.gate(flat).softmax(-1)
        top_weight, top_expert = weights.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (top_expert == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * top_weight[rows, None])
        return out.view_as(hidden)


class TinyMoeForCausalLM(PreTrainedModel):
    config_class = TinyMoeConfig

    def __init__(self, config: TinyMoeConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TinyMoE(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_) -> CausalLMOutput:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        logits = self.lm_head(self.norm(hidden))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)
