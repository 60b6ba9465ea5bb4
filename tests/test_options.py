"""The "safe_zero" config block: defaults, validation with actionable errors, version gating."""

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import safe_zero
from safe_zero import SafeZeroConfigError, SafeZeroOptions
from safe_zero.fixes import Fix
from safe_zero.session import Session


def test_no_block_means_every_fix_on_auto():
    assert SafeZeroOptions.from_config({"zero_optimization": {"stage": 3}}) == SafeZeroOptions()
    assert SafeZeroOptions.from_config(None) == SafeZeroOptions()


def test_a_full_block_is_read():
    options = SafeZeroOptions.from_config({"safe_zero": {
        "fixes": {"gradless_params": False, "zero_element_groups": True},
        "alignment": True, "alignment_guard": False}})
    assert options.fixes == {"gradless_params": False, "zero_element_groups": True}
    assert options.alignment is True and options.alignment_guard is False


def test_the_rank_options_are_read():
    options = SafeZeroOptions.from_config({"safe_zero": {"optional_modules": ["vision_tower", "Adapter"],
                                                         "find_unused_parameters": False}})
    assert options.optional_modules == ("vision_tower", "Adapter") and options.find_unused_parameters is False
    assert SafeZeroOptions().optional_modules == () and SafeZeroOptions().find_unused_parameters is True


@pytest.mark.parametrize("setting, listed, found", [(None, (), True), (["tower"], ("tower",), True), (False, (), False),
                                                    (True, (), True)])
def test_modules_some_ranks_skip_are_found_unless_optional_modules_is_false(setting, listed, found):
    block = {} if setting is None else {"optional_modules": setting}
    options = SafeZeroOptions.from_config({"safe_zero": block})
    assert options.optional_modules == listed and options.find_optional_modules is found


@pytest.mark.parametrize("block, message", [
    ({"fixs": {}}, r"unknown key\(s\) \['fixs'\]"),
    ({"fixes": {"no_such_fix": True}}, "unknown fix 'no_such_fix'.*known fixes"),
    ({"fixes": {"gradless_params": "yes"}}, 'must be "auto", true or false'),
    ({"alignment": "always"}, 'safe_zero.alignment" must be "auto", true or false'),
    ({"alignment_guard": "on"}, "alignment_guard"),
    ({"optional_modules": "tower"}, "optional_modules\" must be a list"),
    ({"optional_modules": [3]}, "optional_modules\" must be a list"),
    ({"find_unused_parameters": "no"}, "find_unused_parameters\" must be true or false"),
    ({"module_order_timeout": 0}, "module_order_timeout\" must be a number of seconds"),
    ({"module_order_timeout": "5"}, "module_order_timeout\" must be a number of seconds"),
    ([], "must be an object"),
])
def test_malformed_blocks_are_rejected_with_what_to_write(block, message):
    with pytest.raises(SafeZeroConfigError, match=message):
        SafeZeroOptions.from_config({"safe_zero": block})


def test_auto_follows_the_deepspeed_version_and_true_false_override_it(monkeypatch):
    fix = Fix("probe", "a probe", SpecifierSet("<0.19.8"), no_probe="a test stand-in")
    monkeypatch.setattr(safe_zero.session, "DEEPSPEED_VERSION", Version("0.18.9"))
    assert Session().uses(fix)
    monkeypatch.setattr(safe_zero.session, "DEEPSPEED_VERSION", Version("0.19.8"))
    assert not Session().uses(fix)
    forced = Session(options=SafeZeroOptions(fixes={"probe": True}))
    assert forced.uses(fix)
    off = Session(options=SafeZeroOptions(fixes={"probe": False}))
    monkeypatch.setattr(safe_zero.session, "DEEPSPEED_VERSION", Version("0.18.9"))
    assert not off.uses(fix)


def test_every_fix_declares_a_version_range_inside_the_supported_one():
    for name, fix in safe_zero.FIXES.items():
        assert fix.name == name and fix.summary
        assert any(v in fix.needed_on for v in ("0.18.0", "0.18.9", "0.19.0", "0.19.6", "0.19.7", "0.19.8")), name


def test_the_parameter_alignment_constant_matches_this_deepspeeds_config():
    """DEEPSPEED_PADS_PARAMETERS (from PARAMETER_ALIGNMENT_OPTION) is what safe_zero, the doctor and the tests decide
    by: it must match the real config."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from safe_zero._compat import DEEPSPEED_PADS_PARAMETERS

    assert DEEPSPEED_PADS_PARAMETERS == ("parameter_alignment" in DeepSpeedZeroConfig.model_fields)
