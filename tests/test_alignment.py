"""Detection of grouped_mm weights, the alignment decision, and how the adjusted config reaches DeepSpeed."""

from __future__ import annotations

import inspect
import json
import types
import warnings

import pytest
import torch
from torch import nn

import safe_zero
from safe_zero import alignment
from safe_zero._compat import DEEPSPEED_PADS_PARAMETERS
from safe_zero.options import pass_config
from safe_zero.options import SafeZeroOptions
from safe_zero.session import Session
from tests.support.models import OddExperts, TinyGptOss, build, ds_config, skip_without_grouped_mm_transformers



# --- detection ---------------------------------------------------------------------------------------------


def test_gpt_oss_experts_weights_are_detected_and_nothing_else():
    skip_without_grouped_mm_transformers()  # GPT-OSS and its grouped_mm experts are Transformers 5's
    model = build(TinyGptOss)
    found = safe_zero.grouped_mm_parameters(model)
    assert sorted(found) == ["lm.model.layers.0.mlp.experts.down_proj", "lm.model.layers.0.mlp.experts.gate_up_proj"]
    assert all(p.dim() == 3 for p in found.values())


def test_an_experts_module_on_another_implementation_is_not_detected():
    skip_without_grouped_mm_transformers()  # GPT-OSS and its grouped_mm experts are Transformers 5's
    model = build(TinyGptOss)
    model.lm.set_experts_implementation("eager")
    assert safe_zero.grouped_mm_parameters(model) == {}


class _ThreeD(nn.Module):
    """A 3-D parameter without grouped_mm (Llama4/Dbrx style): shape alone is not the signal."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 8, 8))
        self.bias = nn.Parameter(torch.zeros(2, 8))


def test_a_three_d_parameter_alone_is_not_detected_and_marking_is_explicit():
    model = _ThreeD()
    assert safe_zero.grouped_mm_parameters(model) == {}
    assert safe_zero.mark_grouped_mm(model) is model  # a module marks its 3-D parameters
    assert list(safe_zero.grouped_mm_parameters(model)) == ["w"]
    other = _ThreeD()
    safe_zero.mark_grouped_mm(other.bias)  # a parameter is marked as it is
    assert list(safe_zero.grouped_mm_parameters(other)) == ["bias"]
    with pytest.raises(TypeError, match="nn.Module or nn.Parameter"):
        safe_zero.mark_grouped_mm(torch.zeros(3))


def test_the_hand_made_layout_is_detected_through_its_mark():
    assert list(safe_zero.grouped_mm_parameters(build(OddExperts))) == ["experts"]


# --- the decision --------------------------------------------------------------------------------------------


def _prepare(model, config):
    session = Session(options=SafeZeroOptions.from_config(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adjusted = alignment.prepare_config(model, config, session)
    warned = [str(w.message) for w in caught if issubclass(w.category, safe_zero.AlignmentWarning)]
    return adjusted, session.alignment, warned


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_gets_parameter_alignment_where_deepspeed_has_it(stage):
    config = ds_config(stage)
    adjusted, plan, warned = _prepare(build(OddExperts), config)
    assert plan.active and plan.guard and list(plan.params) == ["experts"] and not warned
    assert "parameter_alignment" not in config["zero_optimization"], "the caller's config must not be mutated"
    if DEEPSPEED_PADS_PARAMETERS:
        assert adjusted["zero_optimization"]["parameter_alignment"] is True
        assert {k: v for k, v in adjusted.items() if k != "zero_optimization"} == \
            {k: v for k, v in config.items() if k != "zero_optimization"}
    else:  # < 0.19.7: no such key (DeepSpeed would reject it); safe_zero's subclass lays the buffer out
        assert adjusted is None


@pytest.mark.parametrize("stage", [0, 3])
def test_other_stages_keep_their_config(stage):
    adjusted, plan, _ = _prepare(build(OddExperts), ds_config(stage))
    assert adjusted is None and plan.active


def test_the_decision_is_deterministic_for_a_resumed_run():
    first, _, _ = _prepare(build(OddExperts), ds_config(2))
    again, _, _ = _prepare(build(OddExperts, seed=1), ds_config(2))
    assert first == again


def test_no_grouped_mm_no_change():
    adjusted, plan, warned = _prepare(nn.Linear(3, 3), ds_config(2))
    assert adjusted is None and not plan.active and not plan.guard and not warned


def test_alignment_true_pads_without_detection_and_guard_can_be_turned_off():
    config = ds_config(2)
    config["safe_zero"] = {"alignment": True, "alignment_guard": False}
    adjusted, plan, _ = _prepare(nn.Linear(3, 3), config)
    assert plan.active and plan.everything and not plan.guard
    assert (adjusted is not None and adjusted["zero_optimization"]["parameter_alignment"]) or \
        not DEEPSPEED_PADS_PARAMETERS


def test_alignment_false_is_respected_with_a_warning_naming_the_consequence():
    config = ds_config(2)
    config["safe_zero"] = {"alignment": False}
    adjusted, plan, warned = _prepare(build(OddExperts), config)
    assert adjusted is None and not plan.active and not plan.guard
    assert len(warned) == 1 and '"alignment": false' in warned[0] and "experts" in warned[0]
    assert "expected data_ptr to be aligned to 16 bytes" in warned[0]


@pytest.mark.skipif(not DEEPSPEED_PADS_PARAMETERS, reason="zero_optimization.parameter_alignment is new in 0.19.7")
def test_a_user_parameter_alignment_setting_is_kept():
    off = ds_config(2, parameter_alignment=False)
    adjusted, plan, warned = _prepare(build(OddExperts), off)
    assert adjusted is None and not plan.active
    assert len(warned) == 1 and "parameter_alignment" in warned[0]
    on = ds_config(2, parameter_alignment=True)
    adjusted, plan, warned = _prepare(build(OddExperts), on)
    assert adjusted is None and plan.active and not warned


# --- the adjusted config reaches DeepSpeed by the caller's route ---------------------------------------------


def _bind(**kwargs):
    import deepspeed

    return inspect.signature(deepspeed.initialize).bind(**kwargs)


def test_pass_config_keeps_the_callers_route():
    new = {"new": True}
    bound = _bind(model=None, config="ds.json")
    pass_config(bound, new)
    assert bound.arguments["config"] is new
    bound = _bind(model=None, config_params="ds.json")
    pass_config(bound, new)
    assert bound.arguments["config_params"] is new and "config" not in bound.arguments
    args = types.SimpleNamespace(deepspeed_config="ds.json", local_rank=0)
    bound = _bind(args=args, model=None)
    pass_config(bound, new)
    assert bound.arguments["args"].deepspeed_config is new and "config" not in bound.arguments
    assert args.deepspeed_config == "ds.json", "the caller's args must stay as they were"


def _initialize_from_path(path: str, via_args: bool) -> dict:
    model = build(OddExperts)
    if via_args:
        args = types.SimpleNamespace(deepspeed_config=path, local_rank=0)
        engine, *_ = safe_zero.initialize(args=args, model=model, model_parameters=model.parameters())
        untouched = args.deepspeed_config == path
    else:
        engine, *_ = safe_zero.initialize(model=model, model_parameters=model.parameters(), config=path)
        untouched = True
    return {"parameter_alignment": getattr(engine._config.zero_config, "parameter_alignment", None),
            "offset": engine.module.experts.data_ptr() % 16, "args_untouched": untouched,
            "report": engine.safe_zero_session.report.get("grouped_mm_alignment")}


@pytest.mark.parametrize("via_args", [False, True], ids=["config-path", "args.deepspeed_config"])
def test_a_config_file_gets_alignment_too(ranks, tmp_path, via_args):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(2)))
    (r,) = ranks.run(1, _initialize_from_path, path=str(path), via_args=via_args)
    assert r["offset"] == 0 and r["args_untouched"] and r["report"]
    assert r["parameter_alignment"] is (True if DEEPSPEED_PADS_PARAMETERS else None)
    assert json.loads(path.read_text()) == ds_config(2), "the file is not rewritten"


# --- overhead arithmetic -------------------------------------------------------------------------------------


def test_padding_bytes_counts_deepspeeds_inter_parameter_padding():
    # bf16: 8-element grid; 3 -> 5 pad, 64 -> 0, the last parameter never padded.
    assert alignment.padding_bytes([3, 64, 5], element_size=2) == 10
    assert alignment.padding_bytes([16, 32], element_size=2) == 0
    assert alignment.padding_bytes([1, 1], element_size=4) == 12


def test_the_flat_order_puts_whole_16_byte_parameters_first_reading_parked_cpu_data():
    from safe_zero.fixes.grouped_mm_alignment import _aligned_order

    odd = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    weight = nn.Parameter(torch.zeros(4, 8, 8, dtype=torch.bfloat16))
    bias = nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    plan = alignment.AlignmentPlan(params={"weight": weight})
    assert _aligned_order([odd, weight, bias], plan, "test") == [1, 0, 2]
    # ZeRO-1/2's CPU flattening leaves a 1-element fp32 placeholder and the data in cpu_data.
    for p in (odd, weight, bias):
        p.cpu_data, p.data = p.data, torch.empty(1)
    assert _aligned_order([odd, weight, bias], plan, "test") == [1, 0, 2]
