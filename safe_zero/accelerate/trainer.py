"""HF Trainer opt-in: ``Trainer(..., callbacks=[SafeZeroCallback()])``."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from transformers import TrainerCallback

from safe_zero.errors import SafeZeroError
from safe_zero.accelerate.routing import check_routed, check_world_size, install_on_request, session_of, opt_in
from safe_zero.injection import verify_engine

log = logging.getLogger("safe_zero")

_TRAINER_CPU_HINT = (
    "HF Trainer builds that state in TrainingArguments: before creating them, call `configured = "
    "safe_zero.accelerate.cpu_distributed_state()` and pass TrainingArguments(..., "
    "accelerator_config={\"use_configured_state\": configured}).")


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

