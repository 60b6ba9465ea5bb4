"""What every fix declares: its name, the defect, and the DeepSpeed releases that have it, and the registry of the
fixes safe_zero ships (a leaf module, so the options and the session read the registry without importing the fixes,
which import them)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version


@dataclass(frozen=True)
class Fix:
    """One DeepSpeed defect that safe_zero corrects.

    Attributes:
        name: the key used in the ``"safe_zero": {"fixes": {...}}`` config block.
        summary: one line for logs and ``python -m safe_zero doctor``.
        needed_on: the DeepSpeed releases that have the defect; on others the fix stays off
            unless the user forces it with ``true``.
        probe: ``"module:function"`` of a tiny stock run that returns whether this installation has the
            defect (``python -m safe_zero doctor`` runs it); imported only when run.
        no_probe: why the fix has no probe (exactly one of ``probe`` and ``no_probe`` is given).
    """

    name: str
    summary: str
    needed_on: SpecifierSet
    probe: str | None = None
    no_probe: str | None = None

    def __post_init__(self) -> None:
        if (self.probe is None) == (self.no_probe is None):
            raise ValueError(f"Fix {self.name!r}: give a probe or the reason it has none (no_probe), exactly one")

    def needed(self, deepspeed_version: Version) -> bool:
        return deepspeed_version in self.needed_on

    def run_probe(self) -> bool | None:
        """Whether this installation has the defect, by its probe; ``None`` for a fix without one."""
        if self.probe is None:
            return None
        module, _, function = self.probe.partition(":")
        return bool(getattr(importlib.import_module(module), function)())


#: Every fix safe_zero ships, by name, in the order ``safe_zero.fixes`` registers them (``safe_zero.FIXES``).
FIXES: dict[str, Fix] = {}


def register(*fixes: Fix) -> dict[str, Fix]:
    """Add ``fixes`` to :data:`FIXES` and return it; a second fix under a name already taken is an error."""
    for fix in fixes:
        if FIXES.setdefault(fix.name, fix) != fix:
            raise ValueError(f"two fixes are named {fix.name!r}")
    return FIXES
