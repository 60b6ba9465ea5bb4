"""HF Trainer script that ``tests/accelerate/test_trainer.py`` runs under ``accelerate launch``.

A tiny Llama built from a ``LlamaConfig`` (no hub access) whose MLP up-projections are
FP-Quant-style pseudo-quantized linears without master weights: zero-sized ``(0,)`` placeholders
for ``weight`` and ``qweight``, and a trainable ``dqweight`` that autograd leaves without a
gradient (FP-Quant's pseudo-quantization without master weights). Each rank prints ``RESULT <json>`` lines. Modes:

* ``stock-then-import`` (1 process): Trainer with stock DeepSpeed (error recorded), then
  ``import safe_zero.accelerate`` (the DeepSpeed JSON's "safe_zero" block opts in) and a new Trainer.
* ``callback`` (any number of processes): ``Trainer(..., callbacks=[SafeZeroCallback()])``; first
  without the CPU process-state line (the error that says what to pass is recorded), then with it.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

STEPS = 5
DS_CONFIG = "examples/accelerate/zero3.json"


class _PseudoQuantMatmul(torch.autograd.Function):
    """FP-Quant pseudo-quantization without master weights: uses ``dqweight``, returns no gradient for it."""

    @staticmethod
    def forward(ctx, x, dqweight):  # type: ignore[override]
        ctx.save_for_backward(dqweight)
        return x @ dqweight.t()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (dqweight,) = ctx.saved_tensors
        return grad @ dqweight, None


class FPQuantStyleLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # What transformers' FP-Quant integration installs when loading a pre-quantized checkpoint.
        self.weight = nn.Parameter(torch.zeros(0))
        self.qweight = nn.Parameter(torch.zeros(0))
        self.dqweight = nn.Parameter(linear.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PseudoQuantMatmul.apply(x, self.dqweight)


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp.up_proj = FPQuantStyleLinear(layer.mlp.up_proj)
    return model


class Repeat(torch.utils.data.Dataset):
    """The same sequence every time: the loss must fall step after step."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(1))
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids, "labels": self.ids}


def emit(**fields) -> None:
    # One write per line: the ranks share the launcher's stdout, and print() writes the newline apart.
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def train(phase: str, callbacks: list, use_configured_state: bool = False) -> None:
    import deepspeed
    from transformers import Trainer, TrainingArguments

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    model = tiny_llama()
    dq_before = model.model.layers[0].mlp.up_proj.dqweight.detach().clone()
    args = TrainingArguments(output_dir=f"/tmp/safe_zero_trainer_{os.getpid()}", deepspeed=DS_CONFIG,
                             per_device_train_batch_size=2, max_steps=STEPS, learning_rate=3e-3,
                             logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                             accelerator_config={"use_configured_state": use_configured_state})
    try:
        trainer = Trainer(model=model, args=args, train_dataset=Repeat(2 * STEPS * world), callbacks=callbacks)
        trainer.train()
    except Exception as e:  # the stock run's (or the misconfigured run's) error is the result
        emit(phase=phase, rank=rank, error=f"{type(e).__name__}: {e}".splitlines()[0][:500])
        return
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    up = trainer.model.model.layers[0].mlp.up_proj
    with deepspeed.zero.GatheredParameters([up.weight, up.qweight, up.dqweight]):
        shapes = [list(up.weight.shape), list(up.qweight.shape)]
        dq_unchanged = torch.equal(up.dqweight.detach(), dq_before)
    engine = trainer.model_wrapped
    session = getattr(engine, "safe_zero_session", None)
    emit(phase=phase, rank=rank, error=None, losses=losses, world=trainer.accelerator.num_processes,
         stage=engine.zero_optimization_stage(), placeholder_shapes=shapes, dq_unchanged=dq_unchanged,
         safe=session is not None, engaged=sorted(session.report) if session else [])


def main() -> None:
    mode = sys.argv[1]
    if mode == "stock-then-import":
        train("stock", callbacks=[])
        import safe_zero.accelerate  # noqa: F401  the config-file route: the JSON's "safe_zero" block opts in

        train("safe", callbacks=[])
    elif mode == "callback":
        from accelerate.state import AcceleratorState

        from safe_zero.accelerate import SafeZeroCallback, cpu_distributed_state

        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            train("no-cpu-state", callbacks=[SafeZeroCallback()])
            AcceleratorState._reset_state(reset_partial_state=True)  # start over, as a fresh script would
        train("safe", callbacks=[SafeZeroCallback()], use_configured_state=cpu_distributed_state())
    else:
        raise SystemExit(f"unknown mode {mode!r}")

    # A 2-process gloo run can abort in interpreter finalization after training finished (a gloo thread torn down
    # during finalization).
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
