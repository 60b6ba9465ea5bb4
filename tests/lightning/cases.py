"""Lightning and Fabric runs shared by the in-process tests (devices=1, on the rank pool) and two_devices.py.

Every case is a module-level function that returns plain data (lists, bools, ints), so the same
function serves as a rank body of ``rig`` and as one step of the 2-process script.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator
from unittest import mock

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

import safe_zero
from safe_zero.probes import DropGrad
from tests.support import rank_dependent
from tests.support.grouped_mm import recording
from tests.support.models import HAS_GROUPED_MM

STEPS = 5
BATCH = 2


class Core(nn.Module):
    """A zero-sized layer used in the loss, a parameter that gets no gradient, and a grouped_mm expert block.

    ``sink`` (3 elements, 6 bytes in bf16) sits before the experts so that their slice in a flat buffer
    lands off the 16-byte grid unless safe_zero aligns it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.empty = nn.Linear(8, 0, bias=False)
        self.dqweight = nn.Parameter(torch.full((4, 8), 0.125))
        self.sink = nn.Parameter(torch.zeros(3))
        self.experts = safe_zero.mark_grouped_mm(nn.Parameter(torch.randn(2, 8, 8) * 0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = DropGrad.apply(torch.relu(self.dense(x)), self.dqweight)
        # Half the rows go to each expert.
        half = x.shape[0] // 2
        if HAS_GROUPED_MM:
            y = F.grouped_mm(h, self.experts, offs=torch.tensor([half, x.shape[0]], dtype=torch.int32, device=x.device))
        else:  # torch < 2.10: the same product, one expert at a time (these tests need the layout, not the kernel)
            y = torch.cat([h[:half] @ self.experts[0], h[half:] @ self.experts[1]])
        return y.pow(2).mean() + self.sink.sum() * 1e-3 + self.empty(x).sum()


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.core = Core()
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.core(batch)
        self.losses.append(loss.detach().float().item())
        return loss

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.core(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data(world_size: int) -> DataLoader:
    """``STEPS`` batches per rank per epoch, every row the same: losses fall, and a resumed run sees the same data
    whatever order Lightning's sampler draws in."""
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.randn(1, 8, generator=g).repeat(STEPS * BATCH * world_size, 1), batch_size=BATCH)


def build(seed: int) -> Module:
    torch.manual_seed(seed)
    return Module()


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (gathered under ZeRO-3), as float32 copies. Collective under ZeRO-3."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def _trainer(strategy: Any, devices: int, max_steps: int, **kw: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="bf16-mixed",
                      max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


class _CaptureAtStart(pl.Callback):
    """The weights the resumed run starts from (after Lightning restored the checkpoint)."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = full_state(module)


def convert_to_fp32(ckpt: str, out: str, stock: bool = False) -> None:
    """``safe_zero.lightning.convert_zero_checkpoint_to_fp32_state_dict`` (``stock``: Lightning's own). Before Lightning
    2.6 the converter loads DeepSpeed's files with ``torch.load``'s default, which torch 2.6 made
    ``weights_only=True``: torch's own switch restores the old default for the call (a Lightning x torch matter; the
    strategy itself saves and loads through DeepSpeed)."""
    from lightning import __version__
    from lightning.pytorch.utilities import deepspeed as lightning_deepspeed
    from packaging.version import Version

    from safe_zero.lightning import convert_zero_checkpoint_to_fp32_state_dict

    convert = lightning_deepspeed.convert_zero_checkpoint_to_fp32_state_dict if stock else \
        convert_zero_checkpoint_to_fp32_state_dict
    old_default = Version(__version__) < Version("2.6")
    with mock.patch.dict(os.environ, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"} if old_default else {}):
        convert(ckpt, out)


def loads_strictly(module: nn.Module, converted: str) -> bool:
    """Whether the converted fp32 state dict loads into ``module`` with every key matched."""
    result = module.load_state_dict(torch.load(converted, weights_only=False)["state_dict"], strict=False)
    return not result.unexpected_keys and not result.missing_keys


def stage1_converted(tmp: str) -> dict[str, Any]:
    """Fit with ``safe_deepspeed_stage_1``, save, convert with Lightning's converter and with safe_zero's: the keys
    each leaves out, the shapes safe_zero's gives."""
    model = build(seed=0)
    trainer = _trainer("safe_deepspeed_stage_1", 1, STEPS)
    trainer.fit(model, data(1))
    ckpt = os.path.join(tmp, "stage1.ckpt")
    trainer.save_checkpoint(ckpt)
    result: dict[str, Any] = {}
    for name, stock in (("lightning", True), ("safe_zero", False)):
        out = os.path.join(tmp, f"stage1.{name}.pt")
        try:
            convert_to_fp32(ckpt, out, stock=stock)
        except Exception as error:  # noqa: BLE001  (DeepSpeed 0.18.3's zero_to_fp32 fails on a zero-element one)
            result[name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        state = torch.load(out, weights_only=False)["state_dict"]
        fresh = Module()
        missing = fresh.load_state_dict(state, strict=False).missing_keys
        result[name] = {"missing": sorted(missing), "shapes": {k: list(v.shape) for k, v in state.items()}}
    return result


def trainer_fits(strategy: str, devices: int, tmp: str) -> dict[str, Any]:
    """Fit STEPS steps, save, resume from the checkpoint and continue, convert; return what to assert on."""
    import deepspeed

    stock_initialize = deepspeed.initialize
    model = build(seed=0)
    before = model.core.dqweight.detach().clone()
    trainer = _trainer(strategy, devices, STEPS)
    trainer.fit(model, data(devices))
    initialize_restored = deepspeed.initialize is stock_initialize
    engine = trainer.strategy.model
    session = engine.safe_zero_session
    after = full_state(model)
    experts_ptr = model.core.experts.data_ptr() % 16 if model.core.experts.numel() else None
    ckpt = os.path.join(tmp, f"{strategy}.ckpt")
    trainer.save_checkpoint(ckpt)

    # Resume in a fresh Trainer with a differently initialised module, run 2 more steps.
    capture = _CaptureAtStart()
    resumed = build(seed=1)
    trainer2 = _trainer(strategy, devices, STEPS + 2, callbacks=[capture])
    trainer2.fit(resumed, data(devices), ckpt_path=ckpt)
    continued = full_state(resumed)
    # The same 7 steps in one go: the resumed run must match it bit for bit (weights and optimizer state).
    straight = build(seed=0)
    _trainer(strategy, devices, STEPS + 2).fit(straight, data(devices))
    straight_state = full_state(straight)

    converted: dict[str, Any] = {}
    if trainer.global_rank == 0:
        out = os.path.join(tmp, f"{strategy}.fp32.pt")
        convert_to_fp32(ckpt, out)
        fresh = Module()
        converted = {
            "strict_ok": loads_strictly(fresh, out),
            "equal_as_bf16": all(torch.equal(p.detach().to(torch.bfloat16).float(), after[n])
                                 for n, p in fresh.named_parameters()),
            "shapes": {n: list(p.shape) for n, p in fresh.named_parameters()},
        }
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "losses": model.losses,
        "engine": type(engine).__name__,
        "optimizer": type(engine.optimizer).__name__,
        "initialize_restored": initialize_restored,
        "fixes_engaged": sorted(session.report),
        "shapes": {n: list(t.shape) for n, t in after.items()},
        "gradless_unchanged": torch.equal(after["core.dqweight"], before.to(torch.bfloat16).float()),
        "experts_ptr_mod16": experts_ptr,
        "restored_equal": all(torch.equal(capture.state[n], after[n]) for n in after),
        "resumed_steps": trainer2.global_step,
        "resumed_losses": resumed.losses,
        "resume_matches_straight": all(torch.equal(continued[n], straight_state[n]) for n in continued),
        "converted": converted,
    }


def trainer_fails(strategy: Any, devices: int) -> None:
    """Fit with ``strategy`` (a registry name, or a strategy) and let the error out."""
    _trainer(strategy, devices, STEPS).fit(build(seed=0), data(devices))


@contextlib.contextmanager
def stock_deepspeed() -> Iterator[None]:
    """The safe strategy's CPU path with DeepSpeed's own ``initialize``: what the stock names do on a GPU."""
    from unittest import mock

    import deepspeed

    from safe_zero import chaining
    from safe_zero.lightning import _common

    stock = deepspeed.initialize
    with mock.patch.object(chaining, "initialize_through", lambda outer, *a, **k: stock(*a, **k)), \
            mock.patch.object(_common, "require_safe_engine", lambda engine: engine):
        yield


def trainer_with_stock_deepspeed(strategy: str, devices: int) -> None:
    """The safe strategy's CPU path with DeepSpeed's own ``initialize``: what the stock names meet on a GPU."""
    with stock_deepspeed():
        trainer_fails(strategy, devices)


def fabric_fits(strategy: str, devices: int, tmp: str) -> dict[str, Any]:
    """Fabric: STEPS steps, save, load into a fresh module, convert; return what to assert on."""
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    core = Core()
    before = core.dqweight.detach().clone()
    model, optimizer = fabric.setup(core, torch.optim.Adam(core.parameters(), lr=1e-2))
    losses = []
    for x in fabric.setup_dataloaders(data(devices)):
        loss = model(x)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float().item())
    after = full_state(core)
    ckpt = os.path.join(tmp, f"fabric-{strategy}.ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": len(losses)})

    torch.manual_seed(1)
    fresh_core = Core()
    fresh_model, fresh_optimizer = fabric.setup(fresh_core, torch.optim.Adam(fresh_core.parameters(), lr=1e-2))
    state = {"model": fresh_model, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(ckpt, state)
    restored = full_state(fresh_core)

    converted: dict[str, Any] = {}
    if fabric.global_rank == 0:
        out = os.path.join(tmp, f"fabric-{strategy}.fp32.pt")
        convert_to_fp32(ckpt, out)
        plain = Core()
        converted = {
            "strict_ok": loads_strictly(plain, out),
            "equal_as_bf16": all(torch.equal(p.detach().to(torch.bfloat16).float(), after[n])
                                 for n, p in plain.named_parameters()),
        }
    engine = fabric.strategy.model
    return {
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "losses": losses,
        "engine": type(engine).__name__,
        "fixes_engaged": sorted(engine.safe_zero_session.report),
        "shapes": {n: list(t.shape) for n, t in after.items()},
        "gradless_unchanged": torch.equal(after["dqweight"], before.to(torch.bfloat16).float()),
        "restored_equal": all(torch.equal(restored[n], after[n]) for n in after),
        "restored_step": state["step"],
        "converted": converted,
    }



@contextlib.contextmanager
def cpu_without_fp16() -> Iterator[None]:
    """DeepSpeed's CPU accelerator as on a CPU without oneDNN fp16 kernels (it reports fp16 where they exist)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: False
    try:
        yield
    finally:
        del accelerator.is_fp16_supported


def trainer_precision(precision: str, fp16_config: bool = False) -> dict[str, Any]:
    """Two steps at ``precision`` (optionally with an explicit fp16 block) on a CPU without fp16; what ran and
    what was warned."""
    import warnings

    from safe_zero.lightning import PrecisionFallbackWarning, SafeDeepSpeedStrategy

    config = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "fp16": {"enabled": True}}
    strategy = SafeDeepSpeedStrategy(config=config) if fp16_config else SafeDeepSpeedStrategy(stage=2)
    model = build(seed=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught, cpu_without_fp16():
        warnings.simplefilter("always")
        trainer.fit(model, data(1))
    engine = trainer.strategy.model
    return {
        "fallback_warnings": [str(w.message) for w in caught if issubclass(w.category, PrecisionFallbackWarning)],
        "plugin": trainer.precision_plugin.precision,
        "bf16": engine.bfloat16_enabled(),
        "fp16": engine.fp16_enabled(),
        "param_dtype": str(model.core.dense.weight.dtype),
        "losses": model.losses,
    }


def fabric_precision(precision: str) -> dict[str, Any]:
    """Fabric: one step at ``precision`` on a CPU without fp16; what ran and what was warned."""
    import warnings

    from safe_zero.lightning import PrecisionFallbackWarning

    fabric = Fabric(accelerator="cpu", devices=1, strategy="safe_deepspeed_stage_2", precision=precision)
    with warnings.catch_warnings(record=True) as caught, cpu_without_fp16():
        warnings.simplefilter("always")
        fabric.launch()
        torch.manual_seed(0)
        core = Core()
        model, optimizer = fabric.setup(core, torch.optim.Adam(core.parameters(), lr=1e-2))
    loss = model(next(iter(data(1))))
    fabric.backward(loss)
    optimizer.step()
    return {
        "fallback_warnings": [str(w.message) for w in caught if issubclass(w.category, PrecisionFallbackWarning)],
        "plugin": fabric.strategy.precision.precision,
        "bf16": fabric.strategy.model.bfloat16_enabled(),
        "loss_dtype": str(loss.dtype),
        "loss": loss.float().item(),
    }


def trainer_with_gpu_deepspeed(devices: int) -> None:
    """accelerator='cpu' while DeepSpeed's accelerator is not the CPU one."""
    from unittest import mock

    cuda_like = mock.Mock(**{"device_name.return_value": "cuda"})
    with mock.patch("deepspeed.accelerator.get_accelerator", return_value=cuda_like):
        trainer_fails("safe_deepspeed_stage_2", devices)


def trainer_predicts(stage: int) -> dict[str, Any]:
    """Trainer.predict: Lightning's inference engine (a fresh config) through safe_zero, with the user's options."""
    import copy

    from safe_zero.lightning import SafeDeepSpeedStrategy

    strategy = SafeDeepSpeedStrategy(stage=stage)
    strategy.config["safe_zero"] = {"alignment_guard": False}
    model = build(seed=0)
    batch = next(iter(data(1)))
    expected = copy.deepcopy(model.core).to(torch.bfloat16)(batch.to(torch.bfloat16)).float().item()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    outputs = trainer.predict(model, dataloaders=data(1))
    engine = trainer.strategy.model
    return {
        "outputs": [o.float().item() for o in outputs],
        "expected": expected,
        "options_carried": engine.safe_zero_session.options.alignment_guard is False,
        "fixes_engaged": sorted(engine.safe_zero_session.report),
    }


def trainer_through_a_mock() -> dict[str, Any]:
    """Fit with a test's mock (wrapping DeepSpeed's own) bound to ``deepspeed.initialize``: it must be called."""
    from unittest import mock

    import deepspeed

    spy = mock.Mock(wraps=deepspeed.initialize)
    with mock.patch("deepspeed.initialize", spy):
        model = build(seed=0)
        trainer = _trainer("safe_deepspeed_stage_3", 1, 2)
        trainer.fit(model, data(1))
        bound_after = deepspeed.initialize is spy
    engine = trainer.strategy.model
    return {"calls": spy.call_count, "optimizer": type(engine.optimizer).__name__, "losses": model.losses,
            "fixes_engaged": sorted(engine.safe_zero_session.report), "bound_after": bound_after}


class CliModule(Module):
    """:class:`Module` with its own data, as a LightningCLI ``model`` (the CLI needs no datamodule then)."""

    def train_dataloader(self) -> DataLoader:
        return data(self.trainer.world_size)


def cli_fits(tmp: str, yaml_text: str, cli_args: list[str]) -> dict[str, Any]:
    """``LightningCLI(CliModule)`` with ``fit --config <yaml_text> <cli_args>``, as a user's CLI script runs it."""
    from lightning.pytorch.cli import LightningCLI

    config = os.path.join(tmp, "config.yaml")
    with open(config, "w") as f:
        f.write(yaml_text)
    torch.manual_seed(0)
    cli = LightningCLI(CliModule, args=["fit", "--config", config, *cli_args], save_config_callback=None)
    strategy = cli.trainer.strategy
    session = strategy.model.safe_zero_session
    return {
        "strategy": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
        "stage": strategy.config["zero_optimization"]["stage"],
        "offload_param": strategy.config["zero_optimization"].get("offload_param", {}).get("device"),
        "block": strategy.config.get("safe_zero"),
        "alignment_guard": session.options.alignment_guard,
        "fixes_engaged": sorted(session.report),
        "losses": cli.model.losses,
    }


# --- a stock-written checkpoint resumed through safe_zero (issue 16 item 5) ----------------------------------------

#: Steps of the uninterrupted run; the stock run it is compared with saves halfway.
RESUME_STEPS = 4


class GptOssModule(pl.LightningModule):
    """``tests.support.models.TinyGptOss`` (grouped_mm experts behind 2-element attention sinks), a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        from tests.support.models import TinyGptOss

        self.core = TinyGptOss()
        self.losses: list[float] = []

    training_step = Module.training_step
    configure_optimizers = Module.configure_optimizers


def optimizer_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master copy and Adam moments, whole, by name. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in module.named_parameters():
        out[f"{name}:fp32"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}:{key}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


def _fit_gpt_oss(stage: int, devices: int, steps: int, seed: int, seen: list[int], ckpt_path: str | None = None):
    from safe_zero.lightning import SafeDeepSpeedStrategy

    torch.manual_seed(seed)
    model = GptOssModule()
    trainer = _trainer(SafeDeepSpeedStrategy(stage=stage), devices, steps)
    with recording(seen):
        trainer.fit(model, data(devices), ckpt_path=ckpt_path)
    return trainer, model


def trainer_resumes_stock_checkpoint(stage: int, devices: int, tmp: str) -> dict[str, Any]:
    """Stock DeepSpeed through Lightning: RESUME_STEPS steps uninterrupted, and half of them saved with
    ``trainer.save_checkpoint``; then a fresh Trainer resumes the save with ``fit(ckpt_path=...)`` through safe_zero.
    With ``LoadsUnpaddedCheckpoints`` disabled the resume is tried once more (ZeRO-1/2: the layouts differ)."""
    from unittest import mock

    from safe_zero import checkpoint_layout

    half = RESUME_STEPS // 2
    out: dict[str, Any] = {"stock_seen": [], "resumed_seen": []}
    with stock_deepspeed():
        straight, straight_model = _fit_gpt_oss(stage, devices, RESUME_STEPS, 0, out["stock_seen"])
        engine = straight.strategy.model
        out["stock_engine"] = [type(engine.optimizer).__name__, hasattr(engine, "safe_zero_session")]
        out["stock_losses"] = straight_model.losses
        expected = {**full_state(straight_model), **optimizer_state(straight_model)}
        del straight, straight_model, engine

        saver, saved_model = _fit_gpt_oss(stage, devices, half, 0, [])
        ckpt = os.path.join(tmp, f"stock-stage{stage}.ckpt")
        saver.save_checkpoint(ckpt)
        out["saved_losses"] = saved_model.losses
        del saver, saved_model

    # A different seed: whatever the resumed run trains on must come from the checkpoint.
    resumed, resumed_model = _fit_gpt_oss(stage, devices, RESUME_STEPS, 1, out["resumed_seen"], ckpt_path=ckpt)
    engine = resumed.strategy.model
    out["resumed_engine"] = [type(engine.optimizer).__name__, hasattr(engine, "safe_zero_session")]
    out["report"] = dict(engine.safe_zero_session.report)
    out["resumed_steps"] = resumed.global_step
    out["resumed_losses"] = resumed_model.losses
    final = {**full_state(resumed_model), **optimizer_state(resumed_model)}
    out["compared"] = len(expected)
    out["unequal"] = sorted(name for name in expected if not torch.equal(expected[name], final[name]))
    del resumed, resumed_model, engine

    if stage in (1, 2):
        with mock.patch.object(checkpoint_layout, "_without_unpadded_record", lambda state: state):
            try:
                _fit_gpt_oss(stage, devices, RESUME_STEPS, 1, [], ckpt_path=ckpt)
            except Exception as error:  # noqa: BLE001  (the test asserts which)
                out["unfixed_error"] = f"{type(error).__name__}: {error}"
    return out


# --- ranks on their own batches (issue 27 item 6) ------------------------------------------------------------------


class RankDependentMoE(pl.LightningModule):
    """``tests.support.rank_dependent``'s MoE (each rank's tokens go to other experts) with the reference's
    AdamW; records the inputs each step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.net = rank_dependent.MODELS["moe"]()
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append(x.detach().clone())
        return self.net(x, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=rank_dependent.LR, weight_decay=0.0)


def trainer_fits_rank_dependent_experts(devices: int) -> dict[str, Any]:
    """``safe_deepspeed_stage_2`` in fp32 with clipping at 1.0, a ``DistributedSampler`` of our own (unshuffled;
    Lightning keeps a user's, and the one it injects here drew the rows in another order) dealing ``dealt_rows`` so
    that each rank trains on its own batches; the MoE's trained weights by name."""
    from torch.utils.data.distributed import DistributedSampler

    torch.manual_seed(0)  # as tests.support.models.build: the reference's initial weights
    model = RankDependentMoE()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="safe_deepspeed_stage_2", precision="32-true",
                         max_steps=rank_dependent.STEPS, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    rows = rank_dependent.dealt_rows("moe", devices, by="sample")
    trainer.fit(model, DataLoader(rows, batch_size=2, sampler=DistributedSampler(rows, shuffle=False)))
    engine = trainer.strategy.model
    return {"rank": trainer.global_rank, "world_size": trainer.world_size, "steps": trainer.global_step,
            "seen": model.seen, "engine": type(engine).__name__,
            "fixes_engaged": sorted(engine.safe_zero_session.report),
            "params": {n: p.detach().float().clone() for n, p in model.net.named_parameters()}}
