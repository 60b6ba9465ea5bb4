"""What keeping grouped_mm weights 16-byte aligned costs in flat-buffer bytes.

Two layouts are compared per model, for one bf16 flat group holding every trainable parameter
(DeepSpeed's group when the optimizer comes from the config):

* DeepSpeed's ``zero_optimization.parameter_alignment`` (ZeRO-1/2, >= 0.19.7, which safe_zero turns
  on): pads after every parameter whose size is not a whole number of 16-byte units.
* safe_zero's order (``fixes/grouped_mm_alignment``, the routes DeepSpeed does not pad): whole-16-byte
  parameters first, no padding.

The end-of-buffer padding DeepSpeed adds for its partitions is the same in every layout and left out.
Models are built on the meta device, so the real-sized layout allocates nothing.

    python benchmarks/alignment_overhead.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from safe_zero.alignment import ALIGNMENT_BYTES, AlignmentPlan, grouped_mm_parameters, padding_bytes  # noqa: E402
from safe_zero.fixes.grouped_mm_alignment import _aligned_order  # noqa: E402

BF16 = 2


def gpt_oss(hidden: int, expert_intermediate: int, experts: int, layers: int, vocab: int, heads: int,
            kv_heads: int, head_dim: int) -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GptOssConfig(hidden_size=hidden, intermediate_size=expert_intermediate, num_local_experts=experts,
                          num_hidden_layers=layers, vocab_size=vocab, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096)
    with torch.device("meta"):
        return GptOssForCausalLM(config)


def overhead(model: torch.nn.Module) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    numels = [p.numel() for p in params]
    flat = sum(numels) * BF16
    detected = grouped_mm_parameters(model)
    deepspeed_pad = padding_bytes(numels, BF16)
    off_grid = sum(1 for n in numels if n * BF16 % ALIGNMENT_BYTES)
    wanted = {id(p) for p in detected.values()}

    def misaligned(order: list[int]) -> int:
        offset, off = 0, 0
        for i in order:
            off += id(params[i]) in wanted and offset % ALIGNMENT_BYTES != 0
            offset += numels[i] * BF16
        return off

    # The order safe_zero's fix flattens in (raises where one unpadded order cannot align them all).
    safe_order = _aligned_order(params, AlignmentPlan(params=detected, active=True), "benchmark",
                                nbytes=lambda p: p.numel() * BF16)
    return {"params": len(params), "grouped_mm weights": len(detected), "off-grid params": off_grid,
            "misaligned in stock layout": misaligned(list(range(len(params)))),
            "misaligned in safe_zero order": misaligned(safe_order),
            "flat bytes": flat, "parameter_alignment pad": deepspeed_pad,
            "parameter_alignment %": 100.0 * deepspeed_pad / flat, "safe_zero order pad": 0}


def zero3_overhead(model: torch.nn.Module, world_size: int) -> dict:
    """ZeRO-3 at ``world_size`` ranks: what safe_zero adds to stock's partitions and to the all-reduce fetch buffer.

    safe_zero keeps stock's partitions at >= 2 ranks (every all-gather builds a fresh, aligned buffer), so the
    partitions gain nothing; the all-reduce fetch slot of each parameter (``ds_numel_aligned``, a multiple of the
    world size) is rounded up to whole 16-byte units, in the transient gather buffer only.
    """
    grid = ALIGNMENT_BYTES // BF16
    detected = {id(p) for p in grouped_mm_parameters(model).values()}
    params = [p for p in model.parameters() if p.requires_grad]
    slots = [world_size * -(-p.numel() // world_size) for p in params]
    extra = [((-slot) % grid) * BF16 for slot in slots]
    return {"params": len(params), "partition pad": 0, "all-reduce slot pad": sum(extra),
            "all-reduce slot pad max per param": max(extra),
            "grouped_mm partitions off whole 16-byte units": sum(
                1 for p in params if id(p) in detected and -(-p.numel() // world_size) * BF16 % ALIGNMENT_BYTES)}


def main() -> None:
    models = {
        "tiny GPT-OSS (hidden 64, 4 experts x 64 x 32, 1 layer)":
            lambda: gpt_oss(64, 32, 4, layers=1, vocab=128, heads=2, kv_heads=1, head_dim=32),
        "GPT-OSS layout (hidden 2048, 64 experts x 2048 x 768, 24 layers, vocab 201088)":
            lambda: gpt_oss(2048, 768, 64, layers=24, vocab=201088, heads=32, kv_heads=4, head_dim=64),
        # 20 heads: 40-byte attention sinks shift everything after them by 8 bytes per layer.
        "same layout with 20 attention heads (40-byte sinks)":
            lambda: gpt_oss(2048, 768, 64, layers=24, vocab=201088, heads=20, kv_heads=4, head_dim=64),
    }
    for name, build in models.items():
        row = overhead(build())
        print(name)
        print(f"  {row['params']} trainable parameters, {row['grouped_mm weights']} grouped_mm weights, "
              f"{row['off-grid params']} parameters not a whole number of 16-byte units")
        print(f"  stock unpadded layout: {row['misaligned in stock layout']} of {row['grouped_mm weights']} "
              "grouped_mm weights off the 16-byte grid")
        print(f"  flat bf16 buffer: {row['flat bytes']:,} bytes")
        print(f"  DeepSpeed parameter_alignment padding: {row['parameter_alignment pad']:,} bytes "
              f"({row['parameter_alignment %']:.2e} % of the buffer)")
        print(f"  safe_zero flat-buffer order: {row['safe_zero order pad']} bytes of padding, "
              f"{row['misaligned in safe_zero order']} grouped_mm weights off the grid")
        z3 = zero3_overhead(build(), world_size=3)
        print(f"  ZeRO-3 at 3 ranks: {z3['grouped_mm partitions off whole 16-byte units']} grouped_mm partitions not "
              f"whole 16-byte units; safe_zero adds {z3['partition pad']} B to partitions and "
              f"{z3['all-reduce slot pad']} B (max {z3['all-reduce slot pad max per param']} B per parameter) to the "
              "all-reduce fetch buffer")


if __name__ == "__main__":
    main()
