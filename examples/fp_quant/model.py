"""A tiny FP-Quant Llama, built offline, and the data the three training scripts share.

``build_checkpoint(directory)`` does what a user of an FP-Quant model on the Hub gets, without a
download: a tiny Llama from a ``LlamaConfig`` (hidden 64, 2 layers) is saved, quantized by
transformers with ``FPQuantConfig(pseudoquantization=True, store_master_weights=False)`` and saved
again. ``load_model(directory)`` reloads that checkpoint as a user would; transformers then installs
FP-Quant's parameters in every quantized linear layer:

* ``weight`` and ``qweight``: zero-sized ``(0,)`` float32 placeholder parameters, ``requires_grad=True``;
* ``dqweight``: the pseudo-quantized bf16 weight, trainable, but FP-Quant's autograd Function
  returns no gradient for it.

Stock DeepSpeed fails on both (see the top README); safe_zero trains the model.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from cpu_support import enable as enable_cpu_support

#: The tiny Llama: 64 wide (a multiple of FP-Quant's 32-wide Hadamard groups), 2 layers.
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
SEQUENCE = 16


def build_checkpoint(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the FP-Quant checkpoint to ``directory/quantized`` (once; reused if present) and return its path."""
    from transformers import FPQuantConfig, LlamaConfig, LlamaForCausalLM

    enable_cpu_support()
    directory = Path(directory)
    quantized = directory / "quantized"
    if (quantized / "config.json").exists():
        return quantized
    # Built in a private folder and renamed into place: the ranks of a multi-process launch may all get here.
    directory.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=directory))
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).save_pretrained(scratch / "full")
    # In-flight quantization of the full-precision checkpoint, exactly as for a Hub model.
    model = LlamaForCausalLM.from_pretrained(
        scratch / "full", dtype=torch.bfloat16,
        quantization_config=FPQuantConfig(pseudoquantization=True, store_master_weights=False))
    model.save_pretrained(scratch / "quantized")
    try:
        os.rename(scratch / "quantized", quantized)
    except OSError:  # another process finished first: same seed, same checkpoint
        if not (quantized / "config.json").exists():
            raise
    shutil.rmtree(scratch, ignore_errors=True)
    return quantized


def load_model(checkpoint: str | os.PathLike) -> torch.nn.Module:
    """Reload the FP-Quant checkpoint for fine-tuning, as from the Hub.

    ``ignore_mismatched_sizes=True`` is needed for pseudo-quantized checkpoints without master
    weights: FP-Quant's loader hands back ``(0,)`` placeholders where the module declares sized buffers.
    """
    from transformers import LlamaForCausalLM

    enable_cpu_support()
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, ignore_mismatched_sizes=True)
    model.train()
    return model


def summarize(session: Any) -> str:
    """What each safe_zero fix did (``engine.safe_zero_session``), one line per fix, repeats counted."""
    lines = []
    for name, events in sorted(session.counts.items()):
        kinds: Counter[str] = Counter()
        for event, times in events.items():
            kinds[re.sub(r"\(\d+(, \d+)*\)", "(...)", event)] += times
        lines.append(f"  {name}: " + "; ".join(f"{what}" + (f" (x{n})" if n > 1 else "") for what, n in kinds.items()))
    return "\n".join(lines)


def describe(model: torch.nn.Module) -> str:
    """One line: how many zero-sized and how many trainable-but-gradient-less parameters the model carries."""
    zero_sized = sum(1 for p in model.parameters() if p.numel() == 0)
    dqweights = sum(1 for name, p in model.named_parameters() if name.endswith("dqweight") and p.requires_grad)
    return f"{zero_sized} zero-sized placeholder parameters, {dqweights} trainable dqweight parameters (no gradient)"


def dataset(steps: int, batch_size: int = 2, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Samples for ``steps`` batches of ``batch_size``: the same ``batch_size`` token sequences again and again
    (unshuffled), so every batch is the same and the loss must fall as the model fits it."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch_size, SEQUENCE), generator=generator)
    return [{"input_ids": row, "labels": row} for _ in range(steps) for row in ids]
