"""Which modules safe_zero gathers whole under ZeRO-3, and how the "safe_zero" block changes that."""

import pytest
from torch import nn

from safe_zero.doctor import analyse_model
from safe_zero.leaf_modules import experts_beside_root, moe_blocks, optional_modules
from safe_zero.options import SafeZeroConfigError, SafeZeroOptions
from tests.support.models import Control, ExpertMoE, OptionalTower, RootExperts, build


def test_a_block_with_an_experts_module_list_is_detected_and_the_root_never_is():
    model = build(ExpertMoE)
    assert list(moe_blocks(model)) == ["moe"]
    assert moe_blocks(build(Control)) == {}
    root = nn.Module()
    root.experts = nn.ModuleList([nn.Linear(2, 2)])
    assert moe_blocks(root) == {}, "the whole model is DeepSpeed's root module, never a leaf"


def test_the_options_add_and_remove_classes():
    model = build(ExpertMoE)
    assert list(moe_blocks(model, remove=["ExpertBlock"])) == []
    assert list(moe_blocks(model, remove=["tests.support.models.ExpertBlock"])) == []
    assert list(moe_blocks(model, add=["Linear"], remove=["ExpertBlock"])) == ["inp", "moe.router", "moe.experts.0",
                                                                               "moe.experts.1", "moe.experts.2",
                                                                               "moe.experts.3", "head"]
    # An added class inside a detected block stays inside it: the outer block is gathered whole.
    assert list(moe_blocks(model, add=["Linear"]))[:2] == ["inp", "moe"]


def test_the_doctor_lists_the_blocks_of_a_model():
    assert analyse_model(build(ExpertMoE))["zero3_leaf_modules"] == {"moe": "ExpertBlock"}


def test_experts_beside_the_root_are_kept_gathered_and_the_doctor_says_what_they_cost():
    model = build(RootExperts)
    assert list(experts_beside_root(model)) == ["experts"] and experts_beside_root(build(ExpertMoE)) == {}
    assert analyse_model(model)["zero3_kept_gathered"] == {"experts": 4 * (8 + 1) * 4}  # 4 experts, fp32
    assert analyse_model(build(ExpertMoE))["zero3_kept_gathered"] == {}


def test_leaf_module_options_are_validated():
    options = SafeZeroOptions.from_config({"safe_zero": {"leaf_modules": {"add": ["MyBlock"]}}})
    assert options.leaf_modules == {"add": ["MyBlock"]}
    with pytest.raises(SafeZeroConfigError, match="leaf_modules"):
        SafeZeroOptions.from_config({"safe_zero": {"leaf_modules": {"add": "MyBlock"}}})
    with pytest.raises(SafeZeroConfigError, match="leaf_modules"):
        SafeZeroOptions.from_config({"safe_zero": {"leaf_modules": {"include": ["MyBlock"]}}})


def test_optional_modules_are_found_by_name_or_class_outermost_first_and_a_typo_is_an_error():
    model = build(OptionalTower)
    assert list(optional_modules(model, ["tower"])) == ["tower"]
    assert list(optional_modules(model, ["tower", "tower.0"])) == ["tower"], "the outer module covers its children"
    assert list(optional_modules(model, ["Sequential"])) == ["tower"]
    assert optional_modules(model, []) == {}
    with pytest.raises(SafeZeroConfigError, match=r"\['towr'\] name no module"):
        optional_modules(model, ["towr"])
    with pytest.raises(SafeZeroConfigError, match="name no module below the model's root"):
        optional_modules(model, ["OptionalTower"])
