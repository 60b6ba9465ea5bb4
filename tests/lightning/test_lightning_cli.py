"""LightningCLI: the safe strategies from a yaml, by registry name and by class path with ``init_args``.

The yaml below is the README's (section "LightningCLI"). Each run fits ``cases.CliModule`` (a
zero-sized layer, a gradient-less parameter, a grouped_mm expert block) on one CPU process.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lightning")
pytest.importorskip("jsonargparse")

from tests.lightning import cases  # noqa: E402

TRAINER = """\
trainer:
  accelerator: cpu
  devices: 1
  precision: bf16-mixed
  max_steps: {steps}
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
"""

CLASS_PATH = TRAINER + """\
  strategy:
    class_path: safe_zero.lightning.SafeDeepSpeedStrategy
    init_args:
      stage: 3
      offload_parameters: true
      config:
        safe_zero:
          alignment_guard: false
"""


def _check_trained(r: dict) -> None:
    assert r["strategy"] == "safe_zero.lightning.pytorch.SafeDeepSpeedStrategy"
    assert r["stage"] == 3
    assert "zero3_zero_element_params" in r["fixes_engaged"], r["fixes_engaged"]
    losses = r["losses"]
    assert len(losses) == cases.STEPS and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses


def test_lightning_cli_yaml_by_name_and_by_class_path(ranks, tmp_path):
    # --trainer.strategy=safe_deepspeed_stage_3 on the command line (the script imports safe_zero, as cases does).
    (by_name,) = ranks.run(1, cases.cli_fits, tmp=str(tmp_path), yaml_text=TRAINER.format(steps=cases.STEPS),
                           cli_args=["--trainer.strategy=safe_deepspeed_stage_3"])
    _check_trained(by_name)
    assert by_name["block"] is None and by_name["alignment_guard"] is True  # safe_zero's defaults

    # class_path + init_args: stage and offload build the DeepSpeed config, the config's safe_zero block joins it.
    (by_path,) = ranks.run(1, cases.cli_fits, tmp=str(tmp_path), yaml_text=CLASS_PATH.format(steps=cases.STEPS),
                           cli_args=[])
    _check_trained(by_path)
    assert by_path["offload_param"] == "cpu"
    assert by_path["block"] == {"alignment_guard": False} and by_path["alignment_guard"] is False


def test_a_config_of_only_safe_zero_options_joins_the_config_built_from_the_arguments(tmp_path):
    import json

    from safe_zero import SafeZeroConfigError
    from safe_zero.lightning import SafeDeepSpeedStrategy, SafeFabricDeepSpeedStrategy

    block = {"fixes": {"gradless_params": True}, "alignment_guard": False}
    path = tmp_path / "safe_zero.json"
    path.write_text(json.dumps({"safe_zero": block}))
    for strategy in (SafeDeepSpeedStrategy(stage=3, offload_optimizer=True, config={"safe_zero": block}),
                     SafeDeepSpeedStrategy(stage=3, offload_optimizer=True, config=str(path)),
                     SafeFabricDeepSpeedStrategy(stage=3, offload_optimizer=True, config={"safe_zero": block})):
        zero = strategy.config["zero_optimization"]
        assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
        assert strategy.config["safe_zero"] == block

    # A config with DeepSpeed keys is the whole config, as in Lightning: the arguments are ignored.
    full = {"zero_optimization": {"stage": 2}, "safe_zero": block}
    assert SafeDeepSpeedStrategy(stage=3, config=full).config == full
    # A malformed block fails at construction (at the yaml's parse, under LightningCLI), not at fit.
    with pytest.raises(SafeZeroConfigError, match="unknown key"):
        SafeDeepSpeedStrategy(stage=3, config={"safe_zero": {"guard": True}})
