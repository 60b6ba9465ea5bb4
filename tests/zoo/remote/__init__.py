"""Tiny MoE causal LMs written as hub remote code (``trust_remote_code=True``), loaded offline through ``auto_map``.

transformers' in-library MoE models store their experts as fused 3-D tensors; the ``nn.ModuleList`` of expert modules,
each entered only for the tokens routed to it, lives on in remote-code repositories. Each folder here is such a
repository: a config.json whose ``auto_map`` names the configuration and modeling files next to it.

``load()`` builds one (random weights, equal seeds give equal models) and ``batch()`` makes deterministic micro-batches
on which ranks route to different experts: the odd ranks' batches leave most experts of every MoE layer unused.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

#: The folder names, each a remote-code model repository.
REMOTE_MODELS: tuple[str, ...] = ("deepseek_v3", "minimax")

_ROOT = Path(__file__).resolve().parent
BATCH = 2
LENGTH = 16

_modules_cache: str | None = None


def _remove(path: str, pid: int) -> None:
    if os.getpid() == pid:  # not from a forked child that inherited the handler
        shutil.rmtree(path, ignore_errors=True)


def _private_modules_cache() -> None:
    """Point transformers' remote-code cache at a temporary folder of this process, once.

    transformers copies a local folder's code files into HF_MODULES_CACHE (~/.cache/huggingface/modules) and imports
    them from there as ``transformers_modules.<folder>.<hash>``. Ranks started at once would copy into the same files:
    ``shutil.copyfile`` truncates before it writes, so one rank could import a file another is rewriting. A folder
    per process has one writer. HF_MODULES_CACHE is read when transformers is imported, so the environment variable
    comes too late here; dynamic_module_utils reads its module global on every call, which is set instead. A process
    that already imported remote code keeps its cache: its ``transformers_modules`` package is found there only.
    """
    global _modules_cache
    if _modules_cache is not None:
        return
    import transformers.dynamic_module_utils as dynamic

    if dynamic.TRANSFORMERS_DYNAMIC_MODULE_NAME in sys.modules or dynamic.HF_MODULES_CACHE in sys.path:
        _modules_cache = dynamic.HF_MODULES_CACHE
        return
    _modules_cache = tempfile.mkdtemp(prefix="safe_zero_hf_modules_")
    atexit.register(_remove, _modules_cache, os.getpid())
    dynamic.HF_MODULES_CACHE = _modules_cache


def folder(name: str) -> Path:
    if name not in REMOTE_MODELS:
        raise KeyError(f"{name!r} is not one of {REMOTE_MODELS}")
    return _ROOT / name


def load(name: str, seed: int = 0) -> torch.nn.Module:
    """The model of folder ``name`` with random weights drawn under ``torch.manual_seed(seed)``, fp32, in train mode
    with dropout 0. The caller's RNG state is left as it was."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _private_modules_cache()
    # The folder is read, never written (the code is copied into the modules cache), so no copy of it is needed.
    config = AutoConfig.from_pretrained(str(folder(name)), trust_remote_code=True, local_files_only=True)
    config.attention_dropout = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    return model.to(torch.float32).train()


def _vocab_size(name: str) -> int:
    return json.loads((folder(name) / "config.json").read_text())["vocab_size"]


def batch(name: str, rank: int, step: int) -> dict[str, torch.Tensor]:
    """A deterministic micro-batch of ``BATCH`` x ``LENGTH`` tokens seeded from (rank, step); labels = input_ids.

    Even ranks: random tokens, which spread over most experts. Odd ranks: one token repeated, so every position has the
    same hidden state (attention averages equal values) and each MoE layer sends all of them to the same top-k
    experts; the rest of the experts get no token from this rank.
    """
    generator = torch.Generator().manual_seed(1_000_003 * rank + step)
    vocab = _vocab_size(name)
    if rank % 2 == 0:
        input_ids = torch.randint(4, vocab, (BATCH, LENGTH), generator=generator)
    else:
        token = torch.randint(4, vocab, (1,), generator=generator)
        input_ids = token.expand(BATCH, LENGTH).clone()
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
