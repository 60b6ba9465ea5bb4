"""SafeDeepSpeedPlugin, the shipped yaml + JSON pairs and the routing, in the pytest process (no launch)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

pytest.importorskip("accelerate")

import deepspeed  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, DistributedType  # noqa: E402

import safe_zero  # noqa: E402
from safe_zero.injection import STOCK_INITIALIZE  # noqa: E402
from tests.accelerate.launch import EXAMPLES, ROOT  # noqa: E402

PAIRS = {"zero2": (2, "none", "none"), "zero2_offload": (2, "cpu", "none"),
         "zero3": (3, "none", "none"), "zero3_offload": (3, "cpu", "cpu")}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_example_pair_loads_in_accelerate_and_opts_in(name, monkeypatch):
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    from safe_zero.accelerate import SafeDeepSpeedPlugin, is_routed

    stage, offload_optimizer, offload_param = PAIRS[name]
    yaml_path = EXAMPLES / f"{name}.yaml"
    raw = yaml.safe_load(yaml_path.read_text())
    # With deepspeed_config_file, Accelerate rejects these in the yaml: they belong in the JSON.
    assert not {"mixed_precision", "zero_stage"} & (set(raw) | set(raw["deepspeed_config"]))
    cluster = load_config_from_file(str(yaml_path))
    assert cluster.distributed_type == DistributedType.DEEPSPEED
    assert cluster.use_cpu is False, "use_cpu: true would skip DeepSpeed silently"
    assert cluster.deepspeed_config["deepspeed_config_file"] == f"examples/accelerate/{name}.json"

    json_path = ROOT / cluster.deepspeed_config["deepspeed_config_file"]
    config = json.loads(json_path.read_text())
    block = config["safe_zero"]
    safe_zero.SafeZeroOptions.from_config(config)
    assert "auto" not in json.dumps(block), "Accelerate fails on \"auto\" values it does not know"

    # What `accelerate launch` hands the processes: the yaml's deepspeed_config keys and the JSON path.
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(cluster.deepspeed_config))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(json_path))
    plugin = SafeDeepSpeedPlugin()
    assert plugin.zero_stage == stage
    assert (plugin.offload_optimizer_device, plugin.offload_param_device) == (offload_optimizer, offload_param)
    assert plugin.deepspeed_config["safe_zero"] == block
    assert is_routed()


BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}


def test_auto_in_the_block_breaks_stock_accelerate_and_the_plugin_drops_it():
    from safe_zero.accelerate import SafeDeepSpeedPlugin

    block = {"alignment": "auto", "fixes": {"gradless_params": "auto", "zero_element_groups": True}}
    config = {**BASE, "safe_zero": block}
    stock = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(config))
    with pytest.raises(ValueError, match="`safe_zero.alignment` not found in kwargs"):
        stock.deepspeed_config_process(must_match=False)

    plugin = SafeDeepSpeedPlugin(hf_ds_config=copy.deepcopy(config))
    plugin.deepspeed_config_process(must_match=False)  # what Accelerator.prepare does
    assert plugin.deepspeed_config["safe_zero"] == {"fixes": {"zero_element_groups": True}}


def test_plugin_rejects_a_malformed_block():
    from safe_zero.accelerate import SafeDeepSpeedPlugin

    with pytest.raises(safe_zero.SafeZeroConfigError, match="alignment"):
        SafeDeepSpeedPlugin(hf_ds_config={**BASE, "safe_zero": {"alignment": "sometimes"}})


def test_plugin_refuses_ms_amp_where_this_accelerate_has_it():
    """MS-AMP is refused on an Accelerate that has it (< 1.16); on one without it the plugin reads no MS-AMP field."""
    from accelerate.utils import DeepSpeedPlugin

    from safe_zero.accelerate import SafeDeepSpeedPlugin
    from safe_zero.accelerate.plugin import ACCELERATE_HAS_MSAMP

    fields = {f.name for f in dataclasses.fields(DeepSpeedPlugin)}
    assert ACCELERATE_HAS_MSAMP == ("enable_msamp" in fields)
    if ACCELERATE_HAS_MSAMP:
        with pytest.raises(safe_zero.UnreachableModeError, match="MS-AMP"):
            SafeDeepSpeedPlugin(hf_ds_config=copy.deepcopy(BASE), enable_msamp=True)
    else:
        with pytest.raises(TypeError, match="enable_msamp"):
            DeepSpeedPlugin(hf_ds_config=copy.deepcopy(BASE), enable_msamp=True)


def test_plugin_reads_only_fields_this_accelerate_has():
    """Every plugin attribute safe_zero reads exists on the installed DeepSpeedPlugin (a field that a release drops
    must be feature-detected, as enable_msamp is: Accelerate 1.16 removed it and the plugin crashed at construction)."""
    import ast
    import inspect

    from accelerate.utils import DeepSpeedPlugin

    from safe_zero.accelerate import plugin

    tree = ast.parse(inspect.getsource(plugin))
    read = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    own = {name for name in vars(plugin.SafeDeepSpeedPlugin)}
    guarded = {"enable_msamp"} if not plugin.ACCELERATE_HAS_MSAMP else set()
    stock = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(BASE))
    available = set(dir(stock)) | own
    assert read - available - guarded == set()
    SafeDeepSpeedPlugin = plugin.SafeDeepSpeedPlugin
    assert SafeDeepSpeedPlugin(hf_ds_config=copy.deepcopy(BASE)).deepspeed_config["safe_zero"] == {}


def test_plugin_adds_the_block_and_refuses_a_stock_initialize_at_prepare():
    from safe_zero.accelerate import SafeDeepSpeedPlugin, uninstall_on_request

    plugin = SafeDeepSpeedPlugin(hf_ds_config=copy.deepcopy(BASE))
    assert plugin.deepspeed_config["safe_zero"] == {}
    plugin.set_moe_leaf_modules(object())  # routed: Accelerate may go on to deepspeed.initialize
    uninstall_on_request()
    with pytest.raises(safe_zero.InjectionError, match="SafeDeepSpeedPlugin asked for safe_zero"):
        plugin.set_moe_leaf_modules(object())


def test_routing_binds_once_defers_to_install_and_keeps_a_foreign_initialize(monkeypatch):
    from safe_zero.accelerate import install_on_request, is_routed, uninstall_on_request
    from safe_zero.accelerate.routing import _routed_initialize

    install_on_request()
    install_on_request()
    assert deepspeed.initialize is _routed_initialize
    uninstall_on_request()
    assert deepspeed.initialize is STOCK_INITIALIZE and not is_routed()

    safe_zero.install()
    try:
        install_on_request()  # install() already routes every call; leave it
        assert safe_zero.is_installed() and is_routed()
    finally:
        safe_zero.uninstall()
    assert deepspeed.initialize is STOCK_INITIALIZE

    def profiler(*args, **kwargs):
        return STOCK_INITIALIZE(*args, **kwargs)

    monkeypatch.setattr(deepspeed, "initialize", profiler)
    install_on_request()  # binds in front of the profiler (tests/accelerate/test_routing.py runs through it)
    assert deepspeed.initialize is _routed_initialize and is_routed()
    uninstall_on_request()
    assert deepspeed.initialize is profiler, "the function bound before must come back"


def test_python_m_safe_zero_accelerate_runs_the_script_as_main_with_routing(tmp_path, monkeypatch):
    import sys

    from safe_zero.accelerate.__main__ import main

    out = tmp_path / "probe.json"
    probe = tmp_path / "probe.py"
    probe.write_text("import json, sys\nfrom safe_zero.accelerate import is_routed\n"
                     "json.dump({'name': __name__, 'argv': sys.argv, 'routed': is_routed(), 'path0': sys.path[0]},"
                     f" open({str(out)!r}, 'w'))\n")
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setattr(sys, "argv", ["safe_zero.accelerate"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    main([str(probe), "--lr", "1"])
    assert json.loads(out.read_text()) == {"name": "__main__", "argv": [str(probe), "--lr", "1"], "routed": True,
                                           "path0": str(tmp_path)}
