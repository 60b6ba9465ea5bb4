"""The supported-versions table (safe_zero/versions.py) against pyproject.toml, the CI constraints and the README;
the DeepSpeed and torch matrices in docs/versions.md against the scripts that write them."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from safe_zero import FIXES, versions
from safe_zero.errors import UnsupportedVersionError
from safe_zero.versions import SUPPORTED, Supported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _declared() -> dict[str, list[tuple[str | None, SpecifierSet]]]:
    """name -> [(extra or None, specifier)] for every requirement of pyproject.toml."""
    project = _pyproject()
    found: dict[str, list[tuple[str | None, SpecifierSet]]] = {}
    for extra, requirements in [(None, project["dependencies"]), *project["optional-dependencies"].items()]:
        for text in requirements:
            requirement = Requirement(text)
            found.setdefault(requirement.name.lower(), []).append((extra, requirement.specifier))
    return found


def test_each_dependency_is_declared_where_the_table_says_with_its_range():
    declared = _declared()
    for name, supported in SUPPORTED.items():
        assert (supported.extra, supported.allowed) in declared[name], (name, declared[name])
        assert [Version(s.version) for s in supported.allowed if s.operator == ">="] == [Version(supported.floor)], name
        # Another extra may need a newer floor (trl needs transformers 4.56.2), never an older one or another cap.
        for _, specifier in declared[name]:
            assert all(Version(s.version) >= Version(supported.floor) for s in specifier if s.operator == ">="), name
            caps = {s for s in specifier if s.operator in ("<", "<=")}
            assert caps <= {s for s in supported.allowed if s.operator in ("<", "<=")}, (name, specifier)


def test_ci_pins_the_tested_newest_of_every_dependency():
    pins = {}
    with open(os.path.join(ROOT, "constraints", "ci.txt")) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                name, _, version = line.strip().partition("==")
                pins[canonicalize_name(name)] = version
    for name, supported in SUPPORTED.items():
        assert pins.get(name) == supported.ci_pin, f"{name}: constraints/ci.txt pins {pins.get(name)}, " \
                                                    f"safe_zero/versions.py says CI tests {supported.ci_pin}"
        assert supported.newest in supported.allowed and supported.ci_pin in supported.allowed
        # A newest that CI does not run was run by the newest leg: it is newer than CI's, and dated.
        if supported.ci is not None:
            assert Version(supported.ci) < Version(supported.newest), name
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", supported.newest_green_on or ""), name


def test_the_floor_leg_installs_every_testable_floor():
    spec = importlib.util.spec_from_file_location("floors", os.path.join(ROOT, "scripts", "floors.py"))
    floors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(floors)
    with open(os.path.join(ROOT, "Makefile")) as f:
        extras = re.search(r"^FLOOR_EXTRAS\s*:=\s*(\S+)", f.read(), re.M).group(1).split(",")
    pinned = floors.floors(extras)
    assert "torch" in pinned, "the floor leg installs torch's floor too"
    for name, supported in SUPPORTED.items():
        if supported.extra in (None, *extras):
            assert name in pinned and Version(pinned[name]) == Version(supported.floor), name
        else:  # an extra outside the floor leg: its floor must be what the main leg tests
            assert supported.floor == supported.newest, name


def test_readme_table_shows_the_same_ranges():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = readme[readme.index("## Supported versions"):]
    for name, supported in SUPPORTED.items():
        floor = supported.floor if supported.floor_tested else "not tested"
        row = f"| {name} | {floor} | {supported.newest} | `{supported.allowed}` |"
        assert row in table, row
        if supported.newest_green_on:
            assert f"Last green: {supported.newest_green_on}" in table, name


@pytest.mark.parametrize("installed, status", [
    (None, "missing"), ("1.9.0", "older than the floor"), ("2.0.0", "tested"), ("2.1.3", "within the tested range"),
    ("2.4.0", "tested"), ("2.4.0+cpu", "tested"), ("2.5.0", "newer than tested"),
    ("3.0.0", "outside the allowed range"),
])
def test_status_of_an_installed_release(installed, status):
    supported = Supported("pkg", SpecifierSet(">=2.0,<3"), floor="2.0.0", newest="2.4.0")
    assert supported.status(installed) == status


def test_an_untested_floor_is_not_called_tested():
    supported = Supported("pkg", SpecifierSet(">=2.0"), floor="2.0", newest="2.4.0", floor_tested=False)
    assert supported.status("2.0") == "within the tested range"


def test_the_release_ci_pins_below_the_newest_leg_is_tested():
    supported = Supported("pkg", SpecifierSet(">=2.0"), floor="2.0", newest="2.5.0", floor_tested=False, ci="2.3.0",
                          newest_green_on="2026-12-05")
    assert [supported.status(v) for v in ("2.3.0", "2.4.0", "2.5.0", "2.6.0")] == \
        ["tested", "within the tested range", "tested", "newer than tested"]


def test_an_integration_refuses_a_framework_older_than_its_floor(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda name: {"accelerate": "0.34.2"}.get(name))
    refusal = r"needs accelerate>=1\.9\.0 but found 0\.34\.2.*safe-zero\[accelerate\]"
    with pytest.raises(UnsupportedVersionError, match=refusal):
        versions.require("accelerate", "safe_zero.accelerate")
    assert isinstance(UnsupportedVersionError("x"), ImportError)
    versions.require("lightning", "safe_zero.lightning")  # not installed (per the stand-in): nothing to refuse
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.6.6")
    versions.require("lightning", "safe_zero.lightning", installed_as="pytorch-lightning")


def _script(name: str):
    """``scripts/<name>.py`` as a module (``torch_matrix`` imports ``matrix`` beside it)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    return module


def _shown(marker: str) -> str:
    with open(os.path.join(ROOT, "docs", "versions.md")) as f:
        return f.read().split(f"<!-- {marker}:start -->", 1)[1].split(f"<!-- {marker}:end -->", 1)[0].strip()


def _as_the_script_writes(shown: str, matrix, **table_args) -> None:
    """``shown`` is what ``matrix._table`` writes for the rows it shows: a column per fix, the conditions it ran under
    (machine, CPUs, what it ran on, minutes) and no date or commit, which belong to git."""
    header, _, *body = shown.splitlines()
    names = [cell.strip().strip("`") for cell in header.strip("|").split("|")][1:]
    other = table_args.get("other", matrix.OTHER)
    assert set(names) == {*FIXES, other}, names
    rows = {}
    for line in body:
        if not line.startswith("| "):
            break
        release, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[release] = dict(zip([matrix.OTHER if n == other else n for n in names], cells, strict=True))
    ran = re.fullmatch(r"Run on (\S+), (\d+) CPUs, (.+), CPU/gloo, (\d+) min\.", shown.splitlines()[-1])
    assert ran and not re.search(r"\d{4}-\d{2}-\d{2}|\b[0-9a-f]{7,40}\b", ran[0]), shown.splitlines()[-1]
    written = matrix._table(rows, float(ran[4]), ran_on=ran[3], **table_args).splitlines()
    assert shown.splitlines()[:-1] == written[:-1]


def test_the_deepspeed_matrix_in_the_docs_is_what_make_matrix_writes():
    """docs/versions.md's DeepSpeed matrix is written by `make matrix`: a row per release it runs (the DeepSpeed floor
    among them, every one allowed), in its format."""
    matrix = _script("matrix")
    shown = _shown("matrix")
    _as_the_script_writes(shown, matrix)
    assert re.findall(r"^\| (\d+\.\d+\.\d+) \|", shown, re.M) == sorted(matrix.RELEASES, key=Version)
    assert SUPPORTED["deepspeed"].floor in matrix.RELEASES
    assert all(release in SUPPORTED["deepspeed"].allowed for release in matrix.RELEASES)


def test_spot_checked_torch_releases_are_the_torch_matrix_green_rows():
    """The releases doctor calls spot-checked are those `make torch-matrix` last ran green (its table in
    docs/versions.md), and it runs them again next time."""
    torch_matrix = _script("torch_matrix")
    shown = _shown("torch-matrix")
    _as_the_script_writes(shown, torch_matrix.matrix, axis="torch", other=torch_matrix.OTHER)
    rows = re.findall(r"^\| (\d+\.\d+\.\d+) \|(.*)\|$", shown, re.M)
    green = {release for release, cells in rows if not re.search(r"\d+ failed|install failed|import failed", cells)}
    torch = SUPPORTED["torch"]
    assert rows and set(torch.spot_checked) == green, (torch.spot_checked, rows)
    assert all(Version(torch.floor) < Version(r) < Version(torch.newest) for r in torch.spot_checked)
    assert set(torch.spot_checked) <= set(torch_matrix.RELEASES)
