"""Every example under examples/ runs, at a tiny size (3 steps, 1 process), and does what its README says.

Each example is run as a user runs it (a subprocess from the repository root): the loss must fall,
the run must print which safe_zero fixes engaged (the FP-Quant model needs the zero-sized
placeholder fix and the gradient-less ``dqweight`` fix), and the MoE run must print its grouped_mm
expert weights at 16-byte aligned addresses at ZeRO-2 and ZeRO-3, where the same run with
safe_zero's alignment turned off puts them at 12, 12, 8, 8.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
# Both FP-Quant parameter kinds need a fix at ZeRO-3 on every supported DeepSpeed.
FP_QUANT_FIXES = {"gradless_params", "zero3_zero_element_params"}

pytestmark = pytest.mark.slow


def run(*args: str, timeout: float = 400) -> str:
    """Run ``python <args>`` (or ``python -m ...``) from the repository root on CPU; return stdout + stderr."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(args)} timed out after {timeout}s:\n{str(e.stdout)[-4000:]}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{output[-6000:]}"
    return output


def result_line(output: str, tag: str) -> tuple[int, list[float], set[str]]:
    """The ``[<tag>] ZeRO-<stage> losses: ...; safe_zero engaged: ...`` line an example prints."""
    found = re.findall(rf"\[{tag}\] ZeRO-(\d) losses: ([-\d. ]+); safe_zero engaged: (.*)", output)
    assert len(found) == 1, f"expected one [{tag}] result line:\n{output[-4000:]}"
    stage, losses, engaged = found[0]
    return int(stage), [float(v) for v in losses.split()], set(engaged.strip().split(", "))


def check_falls(losses: list[float]) -> None:
    assert len(losses) == STEPS, losses
    assert losses[-1] < losses[0] - 0.3, f"the loss must fall over {STEPS} steps on a repeated batch: {losses}"


@pytest.fixture(scope="module")
def fp_quant_workdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the three FP-Quant runs share their tiny checkpoint: the first run builds it (quantized by
    transformers, saved), the others reload it, as the examples do with ``--workdir``."""
    for module in ("transformers", "lightning", "accelerate", "fp_quant", "triton"):
        pytest.importorskip(module)
    return str(tmp_path_factory.mktemp("fp_quant"))


def check_fp_quant(output: str, tag: str) -> None:
    assert "FP-Quant model: 28 zero-sized placeholder parameters, 14 trainable dqweight parameters" in output, \
        "the reloaded checkpoint carries FP-Quant's placeholders (weight, qweight) and dqweight in its 14 linears"
    stage, losses, engaged = result_line(output, tag)
    assert stage == 3
    check_falls(losses)
    assert engaged == FP_QUANT_FIXES, engaged
    assert "gradless_params: parameter of shape (...) had no gradient; reduced as zeros (x14)" in output
    assert "zero3_zero_element_params: 28 zero-element parameter(s) kept out of ZeRO-3 collectives" in output


def test_fp_quant_lightning(fp_quant_workdir: str) -> None:
    output = run("examples/fp_quant/train_lightning.py", "--workdir", fp_quant_workdir, "--steps", str(STEPS))
    check_fp_quant(output, "lightning")


def test_fp_quant_accelerate_launch(fp_quant_workdir: str) -> None:
    output = run("-m", "accelerate.commands.launch", "--config_file", "examples/accelerate/zero3.yaml",
                 "--num_processes", "1", "examples/fp_quant/train_accelerate.py", "--workdir", fp_quant_workdir,
                 "--steps", str(STEPS))
    check_fp_quant(output, "accelerate rank 0/1")


def test_fp_quant_hf_trainer(fp_quant_workdir: str) -> None:
    output = run("examples/fp_quant/train_hf_trainer.py", "--workdir", fp_quant_workdir, "--steps", str(STEPS))
    check_fp_quant(output, "hf_trainer rank 0/1")


def test_moe_grouped_mm_zero2_and_zero3() -> None:
    for module in ("transformers", "lightning"):
        pytest.importorskip(module)
    output = run("examples/moe_grouped_mm/train.py", "--steps", str(STEPS), "--compare")
    weights = [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("down_proj", "gate_up_proj")]
    for stage in (2, 3):
        safe = {}
        for tag in (r"\[moe\]", r"\[moe, alignment off\]"):
            found = re.findall(rf"{tag} ZeRO-{stage} losses: ([-\d. ]+); safe_zero engaged: (.*)", output)
            assert len(found) == 1, output[-4000:]
            losses, engaged = found[0]
            check_falls([float(v) for v in losses.split()])
            offsets = {name: int(v) for name, v in re.findall(rf"{tag} ZeRO-{stage} (\S+) data_ptr\(\) % 16 = (\d+)",
                                                               output)}
            # 2 layers x (gate_up_proj, down_proj), each seen by its experts' forward in the last step.
            assert sorted(offsets) == weights, offsets
            safe[tag] = (engaged.split(", "), offsets)
        engaged, aligned = safe[r"\[moe\]"]
        assert "grouped_mm_alignment" in engaged, engaged
        assert set(aligned.values()) == {0}, f"ZeRO-{stage}: every expert weight 16-byte aligned: {aligned}"
        # The model is one where alignment matters: without it, the sinks and router biases shift the experts.
        _, unaligned = safe[r"\[moe, alignment off\]"]
        assert unaligned == {weights[0]: 12, weights[1]: 12, weights[2]: 8, weights[3]: 8}, unaligned
