"""What the two TRL recipes share: an offline tokenizer, the SFT data, the run set-up and the result lines.

Nothing here is needed by safe_zero: it makes the recipes run offline (no Hub download) and print
what the test suite checks.
"""

from __future__ import annotations

import os
import socket
import string
import sys
from typing import Any

import torch

sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fp_quant"))
from model import summarize  # noqa: E402  examples/fp_quant/model.py: one report summary for every example

#: Prompt-completion pairs, the SFT format whose loss TRL computes on the completion only. Every batch of 2
#: holds both (the recipes read the rows in order), so the loss must fall as the model fits them.
PAIRS = [
    ("Q: What does ZeRO-3 shard?\nA:", " parameters, gradients and optimizer state."),
    ("Q: What does ZeRO-2 shard?\nA:", " gradients and optimizer state."),
]


def tokenizer() -> Any:
    """A character-level tokenizer (99 tokens: ``<pad>``, ``<eos>``, ``<unk>`` and printable ASCII), built offline.

    Real recipes load the model's own tokenizer (``AutoTokenizer.from_pretrained``); the tiny models here
    are built from configs and have none.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<pad>", "<eos>", "<unk>"] + [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    model = Tokenizer(models.WordLevel({token: i for i, token in enumerate(tokens)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    model.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def dataset(steps: int, world_size: int, batch_size: int) -> Any:
    """``steps`` global batches of the :data:`PAIRS`, as a ``datasets.Dataset`` with prompt/completion columns."""
    from datasets import Dataset

    rows = steps * world_size * batch_size
    return Dataset.from_list([{"prompt": p, "completion": c} for p, c in (PAIRS * rows)[:rows]])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_rendezvous() -> None:
    """``python recipe.py`` without a launcher: DeepSpeed still needs a (one-process) rendezvous."""
    if "LOCAL_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))


def on_cpu() -> bool:
    """No GPU here: the recipes pass ``use_cpu=True`` (see the README's CPU notes)."""
    return not torch.cuda.is_available()


def emit(text: str) -> None:
    """Print ``text`` as one write: the processes of a launch share one pipe, and print() writes the line and its
    newline separately, so two ranks' lines could run together."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{text}\n".encode())


def report_run(trainer: Any, tag: str) -> dict[str, list[str]]:
    """Print ``[<tag> rank r/w] ZeRO-<s> losses: ...; safe_zero engaged: ...`` (and, on rank 0, what each fix did).

    ``trainer.model_wrapped`` is the DeepSpeed engine; one that safe_zero built carries ``safe_zero_session``,
    whose ``report`` names the fixes that acted. A stock engine has none.
    """
    args = trainer.args
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    session = getattr(engine, "safe_zero_session", None)
    report = session.report if session is not None else {}
    engaged = ", ".join(sorted(report)) or ("none" if session is not None else "none (stock DeepSpeed engine)")
    emit(f"[{tag} rank {args.process_index}/{args.world_size}] ZeRO-{engine.zero_optimization_stage()} losses: "
         f"{' '.join(f'{v:.4f}' for v in losses)}; safe_zero engaged: {engaged}")
    if args.process_index == 0 and report:
        emit(summarize(session))
    return report


def finish() -> None:
    """End a multi-process CPU run cleanly: a gloo thread torn down during interpreter finalization can abort the
    process (SIGABRT, "terminate called without an active exception") after training finished."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
