"""The releases of each dependency safe_zero allows, and which of them the suite was last seen green on (a leaf).

``pyproject.toml`` declares the allowed ranges; ``constraints/ci.txt`` pins what ``make test`` installs
(the tested newest, except torch's: CI runs the CPU wheel that installs offline), ``make test-floor`` installs
every floor below, and ``make test-newest`` the newest releases the registry serves. ``tests/test_versions.py``
keeps the three in step with this table, so a range here is one the suite has run at both ends, or the README
says it has not (``floor_tested``).

``python -m safe_zero doctor`` reports the installed release of each against this table, and each
integration refuses, at its import, a framework older than its floor (:func:`require`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from safe_zero.errors import UnsupportedVersionError


@dataclass(frozen=True)
class Supported:
    """One dependency: what ``pyproject.toml`` allows and what the suite last passed on.

    Attributes:
        distribution: the name pip installs.
        allowed: the range ``pyproject.toml`` declares.
        floor: the lowest allowed release (the lower bound of ``allowed``).
        newest: the newest release the suite was last green on: what ``make test`` (``constraints/ci.txt``) pins,
            or, where ``ci`` is set, what ``make test-newest`` installed.
        extra: the ``pip install 'safe-zero[extra]'`` that brings it (``None``: a core dependency).
        floor_tested: whether ``make test-floor`` was last green at ``floor``. Where it was not, the README says
            the floor is allowed, not tested, and doctor does not call it tested.
        ci: the release ``constraints/ci.txt`` pins where it is not ``newest`` (torch: CI stays on the CPU wheel).
        newest_green_on: the date ``make test-newest`` was last green on ``newest``, where CI does not run it.
        spot_checked: releases between floor and newest that ran a subset of the suite, green
            (torch: ``make torch-matrix``, whose table in docs/versions.md says which tests).
    """

    distribution: str
    allowed: SpecifierSet
    floor: str
    newest: str
    extra: str | None = None
    floor_tested: bool = True
    ci: str | None = None
    newest_green_on: str | None = None
    spot_checked: tuple[str, ...] = ()

    @property
    def ci_pin(self) -> str:
        """The release ``make test`` installs (``constraints/ci.txt``)."""
        return self.ci or self.newest

    def status(self, installed: str | None) -> str:
        """``"missing"``, ``"older than the floor"``, ``"tested"``, ``"within the tested range"`` or
        ``"newer than tested"`` (allowed, not yet run by the suite), or ``"outside the allowed range"``."""
        if installed is None:
            return "missing"
        version = Version(Version(installed).base_version)  # "2.13.0+cpu" is 2.13.0
        if version < Version(self.floor):
            return "older than the floor"
        if version not in self.allowed:
            return "outside the allowed range"
        if version > Version(self.newest):
            return "newer than tested"
        tested = {Version(self.newest), Version(self.ci_pin)} | ({Version(self.floor)} if self.floor_tested else set())
        return "tested" if version in tested else "within the tested range"


#: One row per dependency safe_zero integrates with; the README's "Supported versions" table shows the same.
SUPPORTED: dict[str, Supported] = {s.distribution: s for s in (
    # CI pins the CPU wheel on this disk; the newest leg runs the newest torch PyPI serves (a CUDA build, on CPU).
    Supported("torch", SpecifierSet(">=2.4.1"), floor="2.4.1", newest="2.15.0", ci="2.13.0",
              newest_green_on="2026-12-05"),
    # DeepSpeed internals are subclassed; each minor release is checked by `make matrix` before it is allowed.
    # 0.18.0-0.18.2 lack the optimizer's enter_backward, which gradless_params extends (refused at import).
    Supported("deepspeed", SpecifierSet(">=0.18.3,<0.20"), floor="0.18.3", newest="0.19.8"),
    Supported("lightning", SpecifierSet(">=2.4"), floor="2.4.0", newest="2.6.6", extra="lightning"),
    # 1.0-1.8: the Accelerator refuses the process state safe_zero's CPU route creates before it (measured).
    Supported("accelerate", SpecifierSet(">=1.9.0"), floor="1.9.0", newest="1.16.0", extra="accelerate"),
    Supported("transformers", SpecifierSet(">=4.50"), floor="4.50.0", newest="5.25.0", extra="transformers"),
    Supported("trl", SpecifierSet(">=1.16.0"), floor="1.16.0", newest="1.16.0", extra="trl"),
    Supported("peft", SpecifierSet(">=0.21.2"), floor="0.21.2", newest="0.21.2", extra="trl"),
    Supported("fp-quant", SpecifierSet(">=0.3.2"), floor="0.3.2", newest="0.3.2", extra="examples"),
)}


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(distribution: str, integration: str, installed_as: str | None = None) -> None:
    """Refuse, at ``integration``'s import, an installed ``distribution`` older than its floor.

    ``installed_as``: the distribution actually installed where it ships under another name with the same
    releases (``pytorch-lightning`` and ``lightning-fabric`` for ``lightning``).

    Raises:
        UnsupportedVersionError: the installed release is older than the floor, with what to install.
    """
    supported = SUPPORTED[distribution]
    name = installed_as or distribution
    installed = installed_version(name)
    if installed is not None and supported.status(installed) == "older than the floor":
        raise UnsupportedVersionError(
            f"{integration} needs {name}{supported.allowed} but found {installed}. Install a supported release: "
            f"pip install 'safe-zero[{supported.extra}]' (or pip install '{name}{supported.allowed}').")


__all__ = ["SUPPORTED", "Supported", "installed_version", "require"]
