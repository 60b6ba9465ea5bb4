"""The DeepSpeed config as ``deepspeed.initialize`` gets it (read by :func:`resolve_config`, handed back by
:func:`pass_config`), and its ``"safe_zero"`` block, validated.

DeepSpeed ignores unknown top-level config keys, so the block travels inside the same JSON
(or dict) that every launcher already passes around::

    {
      "zero_optimization": {"stage": 3},
      "safe_zero": {
        "fixes": {"zero3_zero_element_params": "auto", "gradless_params": true},
        "alignment": "auto",
        "alignment_guard": true,
        "leaf_modules": {"add": ["MyMoEBlock"], "remove": []},
        "optional_modules": ["vision_tower"],
        "find_unused_parameters": true,
        "module_order_timeout": 300
      }
    }
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Union

from safe_zero.errors import SafeZeroConfigError  # noqa: F401  (re-exported)
from safe_zero.fix import FIXES

Setting = Union[Literal["auto"], bool]

CONFIG_KEY = "safe_zero"


@dataclass(frozen=True)
class SafeZeroOptions:
    """Options of the ``"safe_zero"`` config block.

    Attributes:
        fixes: per-fix switch, by fix name (see ``safe_zero.FIXES``). ``"auto"`` (the default for
            every fix) turns a fix on exactly where the installed DeepSpeed has the defect;
            ``true`` forces it on, ``false`` turns it off.
        alignment: 16-byte alignment of grouped_mm expert weights. ``"auto"`` pads only when the
            model has grouped_mm layers; ``true`` always; ``false`` never (with a warning when the
            model needs it).
        alignment_guard: check that the detected expert weights are 16-byte aligned after
            initialize and after every optimizer step, and raise naming the parameter if not.
        leaf_modules: ZeRO-3 only. ``{"add": [...], "remove": [...]}``: module classes (class name or
            ``module.QualName``) to gather whole as ZeRO-3 leaf modules beyond, or instead of, the MoE
            blocks safe_zero detects (a module whose ``experts`` child is an ``nn.ModuleList``).
        optional_modules: ZeRO-3 only. Modules that some ranks may skip in a forward (a vision tower run
            only for samples with an image, a conditional adapter), by qualified name as in
            ``model.named_modules()`` or by class name. Their parameters stay gathered on every rank
            (like DeepSpeed's persistent parameters), so a rank that skips them makes the same
            collectives as one that runs them, and their gradients are reduced with zeros from the
            ranks that skipped them. Costs their full size in memory on every rank; optimizer state
            stays partitioned. ZeRO-1/2 need nothing and ignore it. Unlisted, such a module is found
            where some ranks skip it while DeepSpeed records its module order (the first forward) and
            kept gathered from then on, as is an ``experts`` ``nn.ModuleList`` beside the model's root;
            the initialize report says which and what they cost. ``false`` turns that off: only the
            modules listed are kept, and ranks that diverge stop with ``RankDivergenceError``.
        find_unused_parameters: DDP's option of the same name, default ``true``: a parameter some rank did not
            use is reduced with a zero gradient from it: one all-reduce and one broadcast in the first backward,
            no collective after it (docs/rank_agreement.md). ``false`` promises
            that every rank uses every trainable parameter in every backward (DDP's default): no
            collective is added, and a rank that sees a parameter without a gradient raises
            ``UnusedParameterError`` instead of training wrong.
        module_order_timeout: ZeRO-3: seconds a rank that left DeepSpeed's recorded module order waits for
            every other rank to leave it at the same point (a change of order on every rank alike) before it
            raises ``RankDivergenceError`` (another rank ran a module it skipped) instead of hanging.
    """

    fixes: Mapping[str, Setting] = field(default_factory=dict)
    alignment: Setting = "auto"
    alignment_guard: bool = True
    leaf_modules: Mapping[str, list[str]] = field(default_factory=dict)
    optional_modules: tuple[str, ...] = ()
    #: Whether modules some ranks skip are found and kept gathered without being listed (``"optional_modules":
    #: false`` turns it off).
    find_optional_modules: bool = True
    find_unused_parameters: bool = True
    module_order_timeout: float = 300.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> "SafeZeroOptions":
        """Read and validate the block from a whole DeepSpeed config (``None``: defaults).

        Raises:
            SafeZeroConfigError: a key or value the block does not allow, saying what it allows.
        """
        block = _block(config)
        fixes = _fixes(block)
        alignment = block.get("alignment", "auto")
        _check_setting(f"{CONFIG_KEY}.alignment", alignment)
        leaf_modules = block.get("leaf_modules", {}) or {}
        if not isinstance(leaf_modules, Mapping) or set(leaf_modules) - {"add", "remove"} or not all(
                isinstance(v, list) and all(isinstance(c, str) for c in v) for v in leaf_modules.values()):
            raise SafeZeroConfigError(f'"{CONFIG_KEY}.leaf_modules" must be {{"add": [class names], "remove": '
                                      f'[class names]}}, got {leaf_modules!r}')
        optional = block.get("optional_modules", [])
        find_optional = optional is not False
        optional = [] if optional is None or isinstance(optional, bool) else optional
        if not isinstance(optional, list) or not all(isinstance(name, str) for name in optional):
            raise SafeZeroConfigError(f'"{CONFIG_KEY}.optional_modules" must be a list of module names or class '
                                      f'names, or false, got {optional!r}')
        timeout = block.get("module_order_timeout", 300.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise SafeZeroConfigError(f'"{CONFIG_KEY}.module_order_timeout" must be a number of seconds > 0, '
                                      f"got {timeout!r}")
        return cls(fixes=fixes, alignment=alignment, alignment_guard=_flag(block, "alignment_guard"),
                   leaf_modules={k: list(v) for k, v in leaf_modules.items()}, optional_modules=tuple(optional),
                   find_optional_modules=find_optional,
                   find_unused_parameters=_flag(block, "find_unused_parameters"),
                   module_order_timeout=float(timeout))


_KEYS = ("fixes", "alignment", "alignment_guard", "leaf_modules", "optional_modules", "find_unused_parameters",
         "module_order_timeout")


def _block(config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    block = (config or {}).get(CONFIG_KEY, {})
    if block is None:
        return {}
    if not isinstance(block, Mapping):
        raise SafeZeroConfigError(f'"{CONFIG_KEY}" must be an object, got {type(block).__name__}')
    unknown = set(block) - set(_KEYS)
    if unknown:
        raise SafeZeroConfigError(f'unknown key(s) {sorted(unknown)} in "{CONFIG_KEY}"; allowed: {sorted(_KEYS)}')
    return block


def _fixes(block: Mapping[str, Any]) -> dict[str, Any]:
    fixes = block.get("fixes", {}) or {}
    if not isinstance(fixes, Mapping):
        raise SafeZeroConfigError(f'"{CONFIG_KEY}.fixes" must map fix names to "auto", true or false')
    for name, setting in fixes.items():
        if name not in FIXES:
            raise SafeZeroConfigError(f'unknown fix {name!r} in "{CONFIG_KEY}.fixes"; known fixes: {sorted(FIXES)}')
        _check_setting(f"{CONFIG_KEY}.fixes.{name}", setting)
    return dict(fixes)


def _flag(block: Mapping[str, Any], key: str) -> bool:
    """A true/false key whose default is true."""
    value = block.get(key, True)
    if not isinstance(value, bool):
        raise SafeZeroConfigError(f'"{CONFIG_KEY}.{key}" must be true or false, got {value!r}')
    return value


def zero_stage(config: Mapping[str, Any] | None) -> int:
    """The ZeRO stage a DeepSpeed config selects (0 where it names none)."""
    return int(((config or {}).get("zero_optimization") or {}).get("stage", 0) or 0)


def _check_setting(where: str, value: Any) -> None:
    if value != "auto" and not isinstance(value, bool):
        raise SafeZeroConfigError(f'"{where}" must be "auto", true or false, got {value!r}')


# The whole DeepSpeed config, as deepspeed.initialize gets it: read it (resolve_config), hand it back (pass_config).

def resolve_config(arguments: Mapping[str, Any]) -> dict[str, Any] | None:
    """The DeepSpeed config ``deepspeed.initialize`` will use, as a dict, from its bound arguments."""
    config = arguments.get("config") or arguments.get("config_params")
    if config is None:
        args = arguments.get("args")
        config = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is None or isinstance(config, Mapping):
        return dict(config) if config is not None else None
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            text = f.read()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            import hjson  # DeepSpeed's own config reader; accepts what DeepSpeed accepts.
            return dict(hjson.loads(text))
    # DeepSpeedConfig objects and the like: DeepSpeed validates those itself.
    return getattr(config, "_param_dict", None)


def pass_config(bound: inspect.BoundArguments, config: dict[str, Any]) -> None:
    """Make ``bound`` (``deepspeed.initialize``'s arguments) carry ``config`` by the route the caller used."""
    arguments = bound.arguments
    args: Any = arguments.get("args")  # the caller's argparse namespace, or any object with deepspeed_config
    if arguments.get("config") is None and arguments.get("config_params") is None and \
            getattr(args, "deepspeed_config", None) is not None:
        # DeepSpeed refuses a config both in args and in the call; a copy keeps the caller's args unchanged.
        args = copy.copy(args)
        args.deepspeed_config = config
        arguments["args"] = args
    elif arguments.get("config") is None and arguments.get("config_params") is not None:
        arguments["config_params"] = config
    else:
        arguments["config"] = config
