"""Lightning's Trainer and Fabric with ``strategy="safe_deepspeed_*"`` on CPU, one process and two.

The module (``tests.lightning.cases.Core``) has a zero-sized layer used in the loss, a trainable
parameter that gets no gradient and a grouped_mm expert block behind a 6-byte parameter. One
process runs on the rank pool (``ranks``); two processes run ``two_devices.py`` through Lightning's
own launcher, which re-executes the script for rank 1. A rank-dependent MoE trains on two ranks of the rank pool
(each on its own batches) against single-process training on the global batch.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from rig import RankFailure  # noqa: E402
from tests.lightning import cases  # noqa: E402
from tests.support import rank_dependent  # noqa: E402
from tests.support.bodies import FRAGMENT_ASSERT, HOOK_RUNS_WITHOUT_A_GRADIENT  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHAPES = {"dense.weight": [8, 8], "dense.bias": [8], "empty.weight": [0, 8], "dqweight": [4, 8], "sink": [3],
          "experts": [2, 8, 8]}
#: The fix that must have acted in each stage's run (the report names every fix that did). At ZeRO-2 on one rank
#: gradless_params acts in the grad-less parameter's gradient hook, which a torch that runs no hook for a None
#: gradient (2.4-2.6) never calls: stock trains it there.
ENGAGED = {2: {"grouped_mm_alignment"} | ({"gradless_params"} if HOOK_RUNS_WITHOUT_A_GRADIENT else set()),
           3: {"zero3_zero_element_params"}}


def _check_run(r: dict, *, stage: int, world_size: int, prefix: str) -> None:
    assert r["world_size"] == world_size
    assert r["engine"] == "DeepSpeedEngine"
    assert ENGAGED[stage] <= set(r["fixes_engaged"]), r["fixes_engaged"]
    assert r["shapes"] == {prefix + name: shape for name, shape in SHAPES.items()}
    losses = r["losses"]
    assert len(losses) == cases.STEPS
    assert all(abs(v) < float("inf") for v in losses)
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.5 * losses[0], losses
    assert r["gradless_unchanged"], "the parameter that never gets a gradient must keep its value"
    assert r["restored_equal"], "the checkpoint must restore every weight bit for bit"
    if r["rank"] == 0:
        assert r["converted"]["strict_ok"], "the fp32 state dict must load with strict=True"
        assert r["converted"]["equal_as_bf16"], "the fp32 master weights must round to the trained bf16 weights"


def _check_trainer(r: dict, *, stage: int, world_size: int) -> None:
    _check_run(r, stage=stage, world_size=world_size, prefix="core.")
    assert r["optimizer"] == {2: "SafeDeepSpeedZeroOptimizer", 3: "SafeDeepSpeedZeroOptimizer_Stage3"}[stage]
    assert r["steps"] == cases.STEPS
    assert r["initialize_restored"], "the routing must be scoped: deepspeed.initialize is stock again after fit"
    if stage == 2:
        # Without alignment the experts sit 6 bytes off the grid (the 3-element sink before them).
        assert r["experts_ptr_mod16"] == 0
    assert r["resumed_steps"] == cases.STEPS + 2 and len(r["resumed_losses"]) == 2
    assert r["resume_matches_straight"], "resumed training must equal uninterrupted training bit for bit"


def _check_fabric(r: dict, *, world_size: int) -> None:
    _check_run(r, stage=3, world_size=world_size, prefix="")
    assert r["restored_step"] == cases.STEPS


# ---------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_fits_resumes_and_converts_on_one_cpu(ranks, tmp_path, stage):
    (r,) = ranks.run(1, cases.trainer_fits, strategy=f"safe_deepspeed_stage_{stage}", devices=1, tmp=str(tmp_path))
    _check_trainer(r, stage=stage, world_size=1)


def test_the_converter_keeps_zero_element_parameters_lightnings_leaves_out(ranks, tmp_path):
    """ZeRO-1: DeepSpeed's zero_to_fp32, which Lightning's converter calls, leaves the zero-element layer out (or,
    on DeepSpeed 0.18.3, fails on it); safe_zero's converter gives every parameter with its shape."""
    (r,) = ranks.run(1, cases.stage1_converted, tmp=str(tmp_path))
    stock = r["lightning"]
    assert "error" in stock or stock["missing"] == ["core.empty.weight"], stock
    assert r["safe_zero"].get("missing") == [], r["safe_zero"]
    assert r["safe_zero"]["shapes"]["core.empty.weight"] == [0, 8]


def test_fabric_fits_saves_loads_and_converts_on_one_cpu(ranks, tmp_path):
    (r,) = ranks.run(1, cases.fabric_fits, strategy="safe_deepspeed_stage_3", devices=1, tmp=str(tmp_path))
    _check_fabric(r, world_size=1)


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_predicts_through_safe_zero_with_the_users_options(ranks, stage):
    (r,) = ranks.run(1, cases.trainer_predicts, stage=stage)
    assert r["outputs"] == [r["expected"]] * cases.STEPS, "the engine must compute what the module computes"
    assert r["options_carried"], "the strategy's safe_zero block must reach Lightning's inference config"
    if stage == 3:
        assert "zero3_zero_element_params" in r["fixes_engaged"]


def test_a_wrapper_on_deepspeed_initialize_is_called_with_safe_zeros_classes(ranks):
    (r,) = ranks.run(1, cases.trainer_through_a_mock)
    assert r["calls"] == 1, "the mock bound to deepspeed.initialize must see Lightning's call"
    assert r["optimizer"] == "SafeDeepSpeedZeroOptimizer_Stage3" and "zero3_zero_element_params" in r["fixes_engaged"]
    assert len(r["losses"]) == 2 and r["losses"][1] < r["losses"][0]
    assert r["bound_after"], "the strategy must put the mock back"


def test_stock_names_refuse_the_cpu(ranks):
    with pytest.raises(RankFailure, match=r"only supported on CUDA GPUs but `CPUAccelerator` is used"):
        ranks.run(1, cases.trainer_fails, strategy="deepspeed_stage_3", devices=1)


STOCK_ERRORS = {
    # the gradless parameter; before 0.19.6, the zero-sized one inside a partition first (#8298)
    2: r"fragment start (\d+) should be < fragment_end \1" if FRAGMENT_ASSERT else
       r"AttributeError: 'NoneType' object has no attribute 'view'",
    3: r"AssertionError: \{.*'status': 'NOT_AVAILABLE', 'numel': 0",  # the zero-sized layer
}


@pytest.mark.parametrize("stage", [2, 3])
def test_stock_deepspeed_fails_this_module_through_lightning(ranks, stage):
    """The same Lightning path with DeepSpeed's own initialize: DeepSpeed's defects, not the CPU, stop it."""
    with pytest.raises(RankFailure, match=STOCK_ERRORS[stage]):
        ranks.run(1, cases.trainer_with_stock_deepspeed, strategy=f"safe_deepspeed_stage_{stage}", devices=1)


def test_16_mixed_on_cpu_falls_back_to_bf16_with_a_warning(ranks):
    (r,) = ranks.run(1, cases.trainer_precision, precision="16-mixed")
    assert len(r["fallback_warnings"]) == 1 and "bf16-mixed" in r["fallback_warnings"][0]
    assert r["plugin"] == "bf16-mixed" and r["bf16"] and not r["fp16"]
    assert r["param_dtype"] == "torch.bfloat16"
    assert len(r["losses"]) == 2 and r["losses"][1] < r["losses"][0]

    (f,) = ranks.run(1, cases.fabric_precision, precision="16-mixed")
    assert len(f["fallback_warnings"]) == 1
    assert f["plugin"] == "bf16-mixed" and f["bf16"]


def test_bf16_mixed_on_cpu_does_not_warn(ranks):
    (r,) = ranks.run(1, cases.trainer_precision, precision="bf16-mixed")
    assert r["fallback_warnings"] == [] and r["bf16"] and not r["fp16"]


@pytest.mark.parametrize(("precision", "fp16_config", "message"), [
    ("16-true", False, r"SafeLightningError: precision='16-true' cannot run on this CPU"),
    ("bf16-mixed", True, r"SafeLightningError: an enabled \"fp16\" block in the DeepSpeed config cannot run"),
])
def test_fp16_that_cannot_fall_back_is_refused_on_cpu(ranks, precision, fp16_config, message):
    with pytest.raises(RankFailure, match=message):
        ranks.run(1, cases.trainer_precision, precision=precision, fp16_config=fp16_config)


def test_cpu_run_needs_deepspeeds_cpu_accelerator(ranks):
    with pytest.raises(RankFailure, match=r"DeepSpeed's accelerator is 'cuda'. Set DS_ACCELERATOR=cpu"):
        ranks.run(1, cases.trainer_with_gpu_deepspeed, devices=1)


# ---------------------------------------------------------------------------------------------- two processes


def _run_script(args: list[str], timeout: float) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    # A session of its own, so a hang kills Lightning's re-executed rank too.
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{args[0]} did not finish within {timeout}s:\n{out[-6000:]}")
    return proc.returncode, out


TWO_DEVICE_CASES = ["trainer:safe_deepspeed_stage_2", "trainer:safe_deepspeed_stage_3", "fabric:safe_deepspeed_stage_3"]


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    """Every two-process case in one launch: {(case, rank): result}."""
    code, out = _run_script(["tests/lightning/two_devices.py", str(tmp_path_factory.mktemp("two")),
                             *TWO_DEVICE_CASES], timeout=480)
    # Both ranks write to one pipe: decode each marker's JSON wherever it sits.
    decoder = json.JSONDecoder()
    found = [(m.group(1), decoder.raw_decode(out, m.end())[0]) for m in re.finditer(r"SAFE_ZERO_(RESULT|ERROR) ", out)]
    errors = [r for kind, r in found if kind == "ERROR"]
    results = {(r["case"], r["rank"]): r for kind, r in found if kind == "RESULT"}
    return {"code": code, "errors": errors, "results": results, "tail": out[-6000:]}


def _two_device_results(two_devices: dict, case: str) -> list[dict]:
    assert not two_devices["errors"], "\n\n".join(e["error"] + "\n" + e["traceback"] for e in two_devices["errors"])
    found = [two_devices["results"].get((case, rank)) for rank in (0, 1)]
    assert all(found), f"missing per-rank result lines for {case}:\n{two_devices['tail']}"
    return found


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_fits_resumes_and_converts_on_two_cpu_processes(two_devices, stage):
    r0, r1 = _two_device_results(two_devices, f"trainer:safe_deepspeed_stage_{stage}")
    for r in (r0, r1):
        _check_trainer(r, stage=stage, world_size=2)
    assert r0["losses"] == r1["losses"]


def test_fabric_fits_saves_loads_and_converts_on_two_cpu_processes(two_devices):
    r0, r1 = _two_device_results(two_devices, "fabric:safe_deepspeed_stage_3")
    for r in (r0, r1):
        _check_fabric(r, world_size=2)
    assert r0["losses"] == r1["losses"]


def test_two_process_script_exits_cleanly(two_devices):
    _two_device_results(two_devices, TWO_DEVICE_CASES[-1])
    assert two_devices["code"] == 0, two_devices["tail"]


def test_trainer_trains_rank_dependent_experts_on_two_ranks_as_one_process_on_the_global_batch(ranks):
    """Two ranks of the rank pool (a launcher's processes: Lightning launches none), each dealt its own batches by
    Lightning's DistributedSampler: the MoE whose ranks use different experts trains to the weights of
    single-process fp32 training on the global batch (``tests/support/rank_dependent.py``)."""
    for r in ranks.run(2, cases.trainer_fits_rank_dependent_experts, devices=2):
        assert (r["world_size"], r["steps"], r["engine"]) == (2, rank_dependent.STEPS, "DeepSpeedEngine")
        assert "gradless_params" in r["fixes_engaged"], r["fixes_engaged"]
        rank_dependent.assert_trained_on_its_batches_as_the_reference(r, "moe", 2)


# ---------------------------------------------------------------------------------------------- registry, docs

REGISTRY_PROBE = r"""
import json, sys
import lightning_fabric                       # imported before safe_zero: registered by `import safe_zero`
import safe_zero
assert "lightning" not in sys.modules and "pytorch_lightning" not in sys.modules, "import safe_zero imported Lightning"
import lightning, pytorch_lightning          # imported after: registered when their strategies finish importing
from safe_zero.lightning._registration import register_when_imported
register_when_imported()                     # idempotent
from lightning.fabric.strategies import STRATEGY_REGISTRY as fabric_registry
from lightning.pytorch.strategies import StrategyRegistry as trainer_registry
trees = {
    "lightning.pytorch": (trainer_registry, lightning.pytorch.strategies.DeepSpeedStrategy),
    "lightning.fabric": (fabric_registry, lightning.fabric.strategies.DeepSpeedStrategy),
    "pytorch_lightning": (pytorch_lightning.strategies.StrategyRegistry,
                          pytorch_lightning.strategies.DeepSpeedStrategy),
    "lightning_fabric": (lightning_fabric.strategies.STRATEGY_REGISTRY, lightning_fabric.strategies.DeepSpeedStrategy),
}
out = {}
for tree, (registry, stock) in trees.items():
    entries = {name: dict.get(registry, name) for name in registry}
    out[tree] = {name: {"twin": entries.get("safe_" + name, {}).get("init_params") == e["init_params"],
                        "class": getattr(entries.get("safe_" + name, {}).get("strategy"), "__module__", None),
                        "subclass": issubclass(entries.get("safe_" + name, {}).get("strategy", object), stock)}
                 for name, e in entries.items() if e["strategy"] is stock}
    out[tree + ":extra"] = sorted(n for n, e in entries.items() if n.startswith("safe_") and n[5:] not in out[tree])
t = lightning.pytorch.Trainer(strategy="safe_deepspeed_stage_3", accelerator="cpu", devices=1, logger=False)
f = lightning.fabric.Fabric(strategy="safe_deepspeed_stage_2_offload", accelerator="cpu", devices=1)
p = pytorch_lightning.Trainer(strategy="safe_deepspeed", accelerator="cpu", devices=1, logger=False)
out["made"] = [[type(s).__module__, s.config["zero_optimization"]["stage"],
                bool(s.config["zero_optimization"].get("offload_optimizer"))]
               for s in (t.strategy, f.strategy, p.strategy)]
print("PROBE " + json.dumps(out))
"""

EXPECTED_NAMES = {"deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload",
                  "deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme"}


def test_every_lightning_deepspeed_name_has_a_safe_twin_in_every_registry():
    code, out = _run_script(["-c", REGISTRY_PROBE], timeout=300)
    lines = [line for line in out.splitlines() if line.startswith("PROBE ")]
    assert code == 0 and lines, out[-6000:]
    probe = json.loads(lines[0].split(" ", 1)[1])
    ours = {"lightning.pytorch": "safe_zero.lightning.pytorch", "lightning.fabric": "safe_zero.lightning.fabric",
            "pytorch_lightning": "safe_zero.lightning.pytorch_lightning",
            "lightning_fabric": "safe_zero.lightning.lightning_fabric"}
    for tree, module in ours.items():
        assert EXPECTED_NAMES <= set(probe[tree]), (tree, sorted(probe[tree]))
        for name, twin in probe[tree].items():
            assert twin == {"twin": True, "class": module, "subclass": True}, (tree, name, twin)
        assert probe[tree + ":extra"] == [], "a safe_ name without a Lightning original"
    assert probe["made"] == [["safe_zero.lightning.pytorch", 3, False], ["safe_zero.lightning.fabric", 2, True],
                             ["safe_zero.lightning.pytorch_lightning", 2, False]]


def test_every_constructor_option_is_documented_on_the_class():
    import lightning.fabric.strategies as fabric_strategies
    import lightning.pytorch.strategies as trainer_strategies

    from safe_zero.lightning import SafeDeepSpeedStrategy, SafeFabricDeepSpeedStrategy

    for ours, stock in ((SafeDeepSpeedStrategy, trainer_strategies.DeepSpeedStrategy),
                        (SafeFabricDeepSpeedStrategy, fabric_strategies.DeepSpeedStrategy)):
        assert inspect.signature(ours) == inspect.signature(stock), "the constructor must stay Lightning's"
        doc = ours.__doc__
        undocumented = [name for name in inspect.signature(stock).parameters if f"\n    {name}: " not in doc]
        assert undocumented == [], f"{ours.__qualname__} does not document {undocumented}"
        for topic in ("safe_zero.initialize", '"safe_zero"', "DS_ACCELERATOR=cpu", "16-mixed", "bf16-mixed",
                      "16-true", "safe_deepspeed_stage_3"):
            assert topic in doc, f"{ours.__qualname__} does not document {topic}"


IMPORT_ORDER_PROBE = """
from safe_zero.lightning import SafeDeepSpeedStrategy, SafeFabricDeepSpeedStrategy  # before Lightning itself
from safe_zero.lightning.pytorch_lightning import SafeDeepSpeedStrategy as Standalone
import lightning.pytorch, lightning.fabric, pytorch_lightning
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
from pytorch_lightning.strategies import StrategyRegistry as StandaloneRegistry
print("PROBE", StrategyRegistry["safe_deepspeed_stage_3"]["strategy"] is SafeDeepSpeedStrategy,
      STRATEGY_REGISTRY["safe_deepspeed_stage_3"]["strategy"] is SafeFabricDeepSpeedStrategy,
      StandaloneRegistry["safe_deepspeed_stage_3"]["strategy"] is Standalone)
"""


def test_strategy_classes_import_before_lightning():
    # Importing our class first imports Lightning, whose import hook registers our names: the class is
    # still being defined then (seen: "partially initialized module ... has no attribute").
    code, out = _run_script(["-c", IMPORT_ORDER_PROBE], timeout=300)
    assert code == 0, out[-4000:]
    assert "PROBE True True True" in out, out[-4000:]


def _cpu_strategies():
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
    from lightning.pytorch.accelerators import CPUAccelerator as TrainerCPU

    from safe_zero.lightning import SafeDeepSpeedStrategy, SafeFabricDeepSpeedStrategy

    return ((SafeDeepSpeedStrategy, TrainerCPU), (SafeFabricDeepSpeedStrategy, FabricCPU))


def test_a_cpu_strategy_without_devices_says_what_it_needs():
    from safe_zero.lightning import SafeLightningError

    for strategy, cpu in _cpu_strategies():
        # Lightning's own strategy fails an `assert` here (parallel_devices is None until the Trainer sets it).
        with pytest.raises(SafeLightningError, match=r"parallel_devices=\[torch.device\('cpu'\)\]"):
            strategy(accelerator=cpu()).setup_environment()
        with pytest.raises(RuntimeError, match="only supported on CUDA GPUs but `NoneType` is used"):
            strategy().setup_environment()  # no accelerator at all: Lightning's own refusal, unchanged


def test_register_strategies_fills_a_fresh_registry_with_every_lightning_name():
    from lightning.fabric.strategies.registry import _StrategyRegistry

    import safe_zero.lightning

    for strategy, _ in _cpu_strategies():
        lightning_names, ours = _StrategyRegistry(), _StrategyRegistry()
        strategy._lightning_strategy.register_strategies(lightning_names)
        strategy.register_strategies(ours)
        assert sorted(ours) == sorted("safe_" + name for name in lightning_names)
        for name, entry in dict(dict.items(lightning_names)).items():
            twin = dict.get(ours, "safe_" + name)
            assert twin["strategy"] is strategy and twin["init_params"] == entry["init_params"], name
            assert f"``safe_{name}``" in safe_zero.lightning.__doc__, f"safe_{name} is not in the package docstring"
