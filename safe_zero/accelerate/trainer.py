"""HF Trainer glue: the opt-in ``Trainer(..., callbacks=[SafeZeroCallback()])``, and
:func:`allow_trainer_fine_tuning` for quantized models whose quantized weights cannot learn (FP-Quant).

Both serve TRL's trainers (``SFTTrainer`` and the others are ``Trainer`` subclasses) unchanged.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from safe_zero.versions import require

require("transformers", "safe_zero.accelerate's Trainer glue")

from transformers import TrainerCallback  # noqa: E402

from safe_zero.accelerate.routing import check_routed, check_world_size, install_on_request, opt_in, session_of  # noqa: E402
from safe_zero.errors import SafeZeroError  # noqa: E402
from safe_zero.injection import verify_engine  # noqa: E402

log = logging.getLogger("safe_zero")

_TRAINER_CPU_HINT = (
    "Trainer builds it in TrainingArguments: on a CPU host pass use_cpu=True there (TRL: in SFTConfig), and "
    "transformers sets it up with gloo and allows bf16. Or, keeping use_cpu=False, call `configured = "
    "safe_zero.accelerate.cpu_distributed_state()` first and pass accelerator_config={\"use_configured_state\": "
    "configured}.")


class SafeZeroCallback(TrainerCallback):
    """Make HF Trainer build its DeepSpeed engine with safe_zero: ``Trainer(..., callbacks=[SafeZeroCallback()])``.

    DeepSpeed itself is configured as usual (``TrainingArguments(deepspeed=...)`` or an
    ``accelerate launch`` DeepSpeed config). A ``"safe_zero"`` block in that config selects the
    fixes (see :class:`safe_zero.SafeZeroOptions`); without one, the defaults (every fix
    ``"auto"``) apply.

    ``on_init_end`` runs after the Trainer has built its Accelerator and before ``train()``
    prepares the model: it adds ``"safe_zero": {}`` to the active DeepSpeed config if it has no
    block, validates the block and drops its ``"auto"`` settings (the defaults; Trainer and
    Accelerate would fail on them), binds :func:`safe_zero.accelerate.install_on_request`, and checks
    that Accelerate and DeepSpeed count the same processes. ``on_train_begin`` checks that the
    engine was built by safe_zero and logs on the main process which fixes are on and which acted.

    Pass it to the constructor: ``Trainer.add_callback`` comes after ``on_init_end`` and would be
    too late; that case raises at ``on_train_begin`` instead of training stock.

    Raises:
        SafeZeroError: the Trainer does not run DeepSpeed, or the callback was added too late.
        safe_zero.accelerate.WorldSizeMismatchError: on a CPU host, Accelerate counts fewer
            processes than DeepSpeed (the message says what to pass).
        safe_zero.InjectionError: the engine was built by stock DeepSpeed after all.
    """

    def __init__(self) -> None:
        self.requested = False

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from accelerate.state import AcceleratorState
        from accelerate.utils import DistributedType

        accelerator_state = AcceleratorState() if AcceleratorState._shared_state else None
        if accelerator_state is None or accelerator_state.distributed_type != DistributedType.DEEPSPEED:
            raise SafeZeroError(
                "SafeZeroCallback needs a DeepSpeed run: pass TrainingArguments(deepspeed=\"ds_config.json\") (a path "
                "or a dict), or launch with `accelerate launch --config_file <DeepSpeed yaml>`.")
        plugins = accelerator_state.deepspeed_plugins
        for plugin in plugins.values() if isinstance(plugins, dict) else [plugins]:
            opt_in(plugin.deepspeed_config)
        install_on_request()
        check_world_size(_TRAINER_CPU_HINT)
        self.requested = True

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if not self.requested:
            raise SafeZeroError(
                "SafeZeroCallback was added after the Trainer was built (Trainer.add_callback), after the point where "
                "it routes DeepSpeed through safe_zero. Pass it to the constructor: Trainer(..., "
                "callbacks=[SafeZeroCallback()]).")
        session = session_of(model)
        if session is None:
            check_routed(type(self).__name__)
            # The engine's optimizer wrapper tells a stock build from a safe one.
            verify_engine(SimpleNamespace(optimizer=getattr(optimizer, "optimizer", optimizer)))
            return
        if state.is_world_process_zero:
            log.warning("safe_zero: Trainer's DeepSpeed engine built by safe_zero; %s", session.describe())


# ----------------------------------------------------------------------------------------------
# Quantized models whose quantized weights cannot learn.

#: A trainable twin of each quantizer class :func:`allow_trainer_fine_tuning` was given, made once.
_TRAINABLE_TWINS: dict[type, type] = {}


def _trainable_twin(quantizer_class: type) -> type:
    if quantizer_class in _TRAINABLE_TWINS.values():  # already one
        return quantizer_class
    twin = _TRAINABLE_TWINS.get(quantizer_class)
    if twin is None:
        twin = type(quantizer_class.__name__, (quantizer_class,), {
            "__module__": __name__,
            "__doc__": f"{quantizer_class.__qualname__} whose is_trainable is True: see allow_trainer_fine_tuning.",
            "is_trainable": property(lambda self: True),
        })
        _TRAINABLE_TWINS[quantizer_class] = twin
    return twin


def allow_trainer_fine_tuning(model: Any) -> Any:
    """Let HF ``Trainer`` (and TRL's ``SFTTrainer``) fine-tune a quantized model whose quantized weights cannot learn.

    ``Trainer.__init__`` refuses a model whose transformers quantizer says it is not trainable
    (``model.hf_quantizer.is_trainable``): "The model you are trying to fine-tune is quantized with
    QuantizationMethod.FPQUANT but that quantization method do not support training". FP-Quant says
    so for checkpoints without master weights (``FPQuantConfig(store_master_weights=False)``), because
    their quantized linears cannot learn: FP-Quant's autograd Function gives their trainable
    ``dqweight`` no gradient. Everything else in the model (embeddings, norms, ``lm_head``, any layer
    left unquantized) can, and that is what this lets the Trainer fine-tune. The ``dqweight``
    parameters keep their values (without weight decay); under DeepSpeed ZeRO they need safe_zero's
    ``gradless_params`` fix, and FP-Quant's zero-sized placeholders need ``zero3_zero_element_params``
    at ZeRO-3 (both on by default: pass ``SafeZeroCallback``).

    Only this model's quantizer object answers differently (its class becomes a subclass whose
    ``is_trainable`` is ``True``); transformers and every other model are untouched. Works on the
    model itself or on a PEFT ``PeftModel`` wrapping it. Idempotent. Call it before constructing the
    Trainer.

    To train the quantized linears themselves, quantize with master weights (``store_master_weights=True``,
    FP-Quant's quantization-aware training), which transformers lets the Trainer train as is. PEFT
    refuses LoRA on FP-Quant's ``FPQuantLinear`` ("Target module FPQuantLinear() is not supported", a
    PEFT limit), so LoRA can only go on layers FP-Quant left unquantized; a ``PeftModel`` of a
    quantized model needs this call as well.

    Returns:
        ``model``.

    Raises:
        SafeZeroError: ``model`` carries no transformers quantizer (``model.hf_quantizer``): the
            Trainer does not refuse it, and there is nothing to allow.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        raise SafeZeroError(
            f"allow_trainer_fine_tuning: this {type(model).__name__} has no hf_quantizer, so it is not a quantized "
            "transformers model and HF Trainer does not refuse it; pass the model from_pretrained loaded with its "
            "quantization_config (or the PeftModel wrapping it).")
    quantizer.__class__ = _trainable_twin(type(quantizer))
    return model
