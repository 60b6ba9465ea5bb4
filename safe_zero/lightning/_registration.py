"""``safe_`` strategy names in Lightning's registries, as soon as Lightning's strategies are imported.

Lightning resolves ``Trainer(strategy="safe_deepspeed_stage_3")`` from its registry in
``Trainer.__init__``, so the names must be there by then, also in the rank processes Lightning's
launcher re-executes (they import the user's script, hence safe_zero). Importing Lightning from
``import safe_zero`` would cost seconds for users who never touch it, so the registration runs
right after each Lightning ``strategies`` package finishes importing (or at once if it already
has). This module itself imports no Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Sequence

#: Lightning's strategies package -> (our module, our class, the name of its registry there).
TARGETS: dict[str, tuple[str, str, str]] = {
    "lightning.pytorch.strategies": ("safe_zero.lightning.pytorch", "SafeDeepSpeedStrategy", "StrategyRegistry"),
    "lightning.fabric.strategies": ("safe_zero.lightning.fabric", "SafeFabricDeepSpeedStrategy", "STRATEGY_REGISTRY"),
    "pytorch_lightning.strategies": (
        "safe_zero.lightning.pytorch_lightning", "SafeDeepSpeedStrategy", "StrategyRegistry"),
    "lightning_fabric.strategies": (
        "safe_zero.lightning.lightning_fabric", "SafeFabricDeepSpeedStrategy", "STRATEGY_REGISTRY"),
}


def register(strategies_package: str) -> None:
    """Register the ``safe_`` names in the registry of one of :data:`TARGETS`' (imported) packages. Idempotent."""
    module_name, class_name, registry_name = TARGETS[strategies_package]
    ours = sys.modules.get(module_name)
    if ours is not None and not hasattr(ours, class_name):
        return  # our module is mid-import (importing Lightning brought us here): it registers itself at its end
    strategy = getattr(importlib.import_module(module_name), class_name)
    strategy.register_strategies(getattr(sys.modules[strategies_package], registry_name))


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds :data:`TARGETS` packages the usual way and registers our names once each has executed."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        # Only a per-module loader instance can carry the wrapped exec_module (a class would affect every module).
        if loader is not None and not isinstance(loader, type) and hasattr(loader, "exec_module"):
            exec_module = loader.exec_module

            def exec_then_register(module: Any) -> None:
                exec_module(module)
                register(fullname)

            loader.exec_module = exec_then_register  # type: ignore[method-assign]  # this one loader's, as above
        return spec


def register_when_imported() -> None:
    """Register now for the Lightning packages already imported, and after import for the others. Idempotent."""
    if not any(importlib.util.find_spec(top) for top in ("lightning", "pytorch_lightning", "lightning_fabric")):
        return
    for package in TARGETS:
        if package in sys.modules:
            register(package)
    if not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
