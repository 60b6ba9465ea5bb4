"""What every fix declares: its name, the defect, and the DeepSpeed releases that have it (a leaf module)."""

from __future__ import annotations

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
    """

    name: str
    summary: str
    needed_on: SpecifierSet

    def needed(self, deepspeed_version: Version) -> bool:
        return deepspeed_version in self.needed_on
