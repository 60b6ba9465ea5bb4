"""ZeRO-3 leaf modules for MoE blocks whose experts are separate modules.

ZeRO-3 gathers parameters module by module, as the forward reaches them. An MoE block that calls
only the experts its tokens were routed to makes each rank gather a different set of experts: the
ranks' all-gathers no longer match, and from the second step DeepSpeed's trace check stops with
``Detected a disagreement on list contents`` (``runtime/zero/utils.py``
``assert_ints_same_as_other_ranks``). A ZeRO-3 *leaf module* is gathered whole when it is entered,
on every rank, and its backward hook reduces all of its parameters in order, zero-filling the
experts a rank did not use (``stage3.py`` ``reduce_leaf_module_grads``): DDP's rule.

DeepSpeed ships a short default list of leaf classes (Mixtral, Qwen2-MoE, Qwen3-MoE) and users
otherwise write their own per model. safe_zero detects the pattern instead: a module whose
``experts`` child is an ``nn.ModuleList`` (remote-code DeepSeek/Kimi/MiniMax-style blocks, most custom
MoE layers). Transformers' fused 3-D experts are single parameters and need nothing. The
``"safe_zero": {"leaf_modules": {"add": [...], "remove": [...]}}`` block adds or removes classes
(by class name or ``module.QualName``).

A module that some ranks skip altogether (an optional vision tower) cannot be a leaf: a rank that
never enters it never gathers it. ``"optional_modules"`` names those; :func:`optional_modules` finds
them and ``safe_zero.fixes.gradless_params`` keeps their parameters gathered on every rank, as it does
:func:`experts_beside_root` and the modules it finds ranks skip in the first forward. That fix also
decides which blocks to gather whole (``blocks_to_gather_whole``): this module only finds them.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from safe_zero.errors import SafeZeroConfigError


def _names(klass: type) -> set[str]:
    return {klass.__name__, f"{klass.__module__}.{klass.__qualname__}"}


def _matches(module: nn.Module, classes: Iterable[str]) -> bool:
    wanted = set(classes)
    return any(_names(klass) & wanted for klass in type(module).__mro__)


def _inside(name: str, found: Iterable[str]) -> bool:
    """Whether module ``name`` lies inside one of the modules already ``found`` (the outer one covers it)."""
    return any(name.startswith(f"{outer}.") for outer in found)


def moe_blocks(model: nn.Module, add: Iterable[str] = (), remove: Iterable[str] = ()) -> dict[str, nn.Module]:
    """The modules of ``model`` to gather whole under ZeRO-3, by qualified name.

    A module whose ``experts`` child is an ``nn.ModuleList``, plus modules of the ``add`` classes,
    minus modules of the ``remove`` classes. An outer block wins over a detected block inside it.
    """
    add, remove = list(add), list(remove)
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        # The root stays a container: DeepSpeed's ZeRO-3 hooks on the whole model are not a leaf's.
        if not name or _inside(name, found):
            continue
        detected = isinstance(getattr(module, "experts", None), nn.ModuleList) or _matches(module, add)
        if detected and not _matches(module, remove):
            found[name] = module
    return found


def experts_beside_root(model: nn.Module) -> dict[str, nn.Module]:
    """The model's own ``experts`` ``nn.ModuleList``, by name: an MoE layer trained as the whole model, whose
    router calls other experts on each rank. The root cannot be gathered whole (:func:`moe_blocks`), so these
    are kept gathered instead, as optional modules."""
    experts = getattr(model, "experts", None)
    return {"experts": experts} if isinstance(experts, nn.ModuleList) else {}


def optional_modules(model: nn.Module, entries: Iterable[str]) -> dict[str, nn.Module]:
    """The modules of ``model`` that ``entries`` name (qualified name or class name), outermost only.

    Raises ``SafeZeroConfigError`` for an entry that names no module below the root: a typo must not
    leave a hang, and every rank runs the root anyway.
    """
    entries = list(entries)
    found: dict[str, nn.Module] = {}
    matched: set[str] = set()
    for name, module in model.named_modules():
        hits = {e for e in entries if e == name or _matches(module, [e])}
        if not name or not hits:
            continue
        matched |= hits
        if not _inside(name, found):
            found[name] = module
    missing = [e for e in entries if e not in matched]
    if missing:
        raise SafeZeroConfigError(f'"safe_zero.optional_modules" entries {missing} name no module below the model\'s '
                                  "root; use a qualified name from model.named_modules() or a class name")
    return found
