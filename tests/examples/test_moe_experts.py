"""examples/moe_experts: a remote-code-style MoE (expert ModuleList) trains at ZeRO-3 through the HF Trainer on 2
CPU processes with no leaf-module configuration (stock DeepSpeed stops on it: tests/fixes/test_gradless_params_ranks.py)."""

from __future__ import annotations

import re

import pytest

from tests.examples.test_examples import STEPS, check_falls, run

pytestmark = pytest.mark.slow


def test_moe_experts_hf_trainer_two_processes(tmp_path) -> None:
    for module in ("transformers", "accelerate"):
        pytest.importorskip(module)
    output = run("-m", "accelerate.commands.launch", "--config_file", "examples/accelerate/zero3.yaml",
                 "--num_processes", "2", "examples/moe_experts/train_hf_trainer.py", "--steps", str(STEPS),
                 "--output-dir", str(tmp_path))
    found = re.findall(r"\[moe_experts rank (\d)/2\] ZeRO-3 losses: ([-\d. ]+); safe_zero engaged: (.*)", output)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], output[-4000:]
    for _, losses, engaged in found:
        values = [float(v) for v in losses.split()]
        assert len(values) == STEPS and values[-1] < values[0], values
        assert "gradless_params" in engaged.split(", ")
    assert "gradless_params: 2 MoE block(s) gathered whole as ZeRO-3 leaf modules (TinyMoE)" in output
