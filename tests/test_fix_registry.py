"""A fix describes itself, and nothing of it is forgotten: every fix module is listed in FIXES, has a probe (or
says why not), a test file, a README row, and mixins in the safe classes (see "A new fix" in docs/developing.md)."""

import pathlib
import pkgutil

import pytest

import safe_zero.fixes
from safe_zero import FIXES, wrappers

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A fix is a module; a package beside it (fixes/gradless/) is the implementation its module re-exports.
MODULES = sorted(m.name for m in pkgutil.iter_modules(safe_zero.fixes.__path__)
                 if not m.name.startswith("_") and not m.ispkg)


def _fix_module(name: str):
    import importlib

    return importlib.import_module(f"safe_zero.fixes.{name}")


def test_every_fix_module_is_in_fixes():
    assert sorted(FIXES.values(), key=lambda f: f.name) == sorted((_fix_module(m).FIX for m in MODULES),
                                                                   key=lambda f: f.name)


@pytest.mark.parametrize("module", MODULES)
def test_a_fix_has_a_test_file_a_readme_row_a_probe_and_a_place_in_the_safe_classes(module):
    fix = _fix_module(module).FIX
    assert fix.name == module, "name the module after FIX.name (the config key)"
    assert (ROOT / "tests" / "fixes" / f"test_{module}.py").is_file(), f"tests/fixes/test_{module}.py"
    assert f"| `{fix.name}` |" in (ROOT / "README.md").read_text(), f"README row for {fix.name} under 'The fixes'"
    assert (fix.probe is None) != (fix.no_probe is None)
    if fix.probe:
        import importlib

        where, _, function = fix.probe.partition(":")
        assert callable(getattr(importlib.import_module(where), function))
    fix_module = _fix_module(module)
    mixins = {mixin for safe in wrappers.OVERRIDING for mixin in safe.__mro__}
    assert any(mixin.__module__ == fix_module.__name__ or getattr(fix_module, mixin.__name__, None) is mixin
               for mixin in mixins), f"no mixin of {module} in wrappers.py's safe classes"
