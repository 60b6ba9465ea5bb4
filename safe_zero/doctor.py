"""``python -m safe_zero doctor [--json] [MODEL]``: what this installation needs from safe_zero.

Reports the versions of the stack, which known DeepSpeed defects this installation has (from
probes that run tiny stock cases, :mod:`safe_zero.probes`), which safe_zero fixes will engage,
and, given a model (``package.module:factory`` or a local Hugging Face model directory), its
zero-sized parameters, trainable parameters that get no gradient, and grouped_mm weights with
their current alignment.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from typing import Any, Iterator

from torch import nn

from safe_zero.versions import SUPPORTED, installed_version


def _versions() -> dict[str, dict[str, str | list[str] | None]]:
    """Per dependency: the installed release, the allowed range, the tested floor and newest (with the date the
    newest leg was last green on it where CI runs another, ``tested_ci``), and where the installed one stands
    (:meth:`safe_zero.versions.Supported.status`)."""
    return {name: {"installed": (installed := installed_version(name)), "allowed": str(supported.allowed),
                   "tested_floor": supported.floor if supported.floor_tested else None,
                   "tested_ci": supported.ci_pin, "tested_newest": supported.newest,
                   "newest_green_on": supported.newest_green_on, "spot_checked": list(supported.spot_checked),
                   "status": supported.status(installed)}
            for name, supported in SUPPORTED.items()}


def check_model_spec(spec: str) -> None:
    """Refuse a MODEL argument that cannot name a model, before any probe runs (they take a while)."""
    usage = "MODEL must be 'package.module:factory' or a local Hugging Face model directory"
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise SystemExit(f"{usage}; the directory {spec!r} has no config.json")
        return
    module_name, _, factory = spec.partition(":")
    if not factory:
        where = "does not exist" if not os.path.exists(spec) else "is not a directory"
        raise SystemExit(f"{usage}; {spec!r} {where}" if os.sep in spec else f"{usage}, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(f"{usage}; cannot import {module_name!r}: {e}") from None
    if not callable(getattr(module, factory, None)):
        raise SystemExit(f"{usage}; {module_name!r} has no callable {factory!r}")


def _load_model(spec: str) -> nn.Module:
    if os.path.isdir(spec):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(spec, local_files_only=True)
    module_name, _, factory = spec.partition(":")
    return getattr(importlib.import_module(module_name), factory)()


def _gradless(model: nn.Module) -> list[str] | None:
    """Trainable parameters left without a gradient by one backward on the model's own dummy inputs."""
    inputs = getattr(model, "dummy_inputs", None)
    if not isinstance(inputs, dict):
        return None
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=inputs.get("input_ids"))
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    found = [n for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0 and p.grad is None]
    model.zero_grad(set_to_none=True)
    return found


def analyse_model(model: nn.Module) -> dict[str, Any]:
    from safe_zero.alignment import grouped_mm_parameters
    from safe_zero.leaf_modules import experts_beside_root, moe_blocks

    return {
        "zero_sized": {n: list(p.shape) for n, p in model.named_parameters() if p.numel() == 0},
        "gradless": _gradless(model),
        "grouped_mm": {n: {"shape": list(p.shape), "data_ptr_mod_16": p.data_ptr() % 16}
                       for n, p in grouped_mm_parameters(model).items()},
        "zero3_leaf_modules": {n: type(m).__name__ for n, m in moe_blocks(model).items()},
        "zero3_kept_gathered": {n: sum(p.numel() * p.element_size() for p in m.parameters())
                                for n, m in experts_beside_root(model).items()},
    }


def diagnose(model_spec: str | None = None) -> dict[str, Any]:
    from safe_zero.probes import init_single_process

    init_single_process()
    import safe_zero
    from safe_zero._compat import DEEPSPEED_VERSION, PARAMETER_ALIGNMENT_OPTION
    from safe_zero.session import Session

    session = Session()
    fixes = {}
    for name, fix in safe_zero.FIXES.items():
        fixes[name] = {
            "summary": fix.summary,
            "needed_on": str(fix.needed_on),
            "defect_present": fix.run_probe(),
            "engages": session.uses(fix),
        }
    report: dict[str, Any] = {
        "versions": _versions(),
        "supported_deepspeed": str(safe_zero.SUPPORTED_DEEPSPEED),
        "deepspeed_parameter_alignment_option": DEEPSPEED_VERSION in PARAMETER_ALIGNMENT_OPTION,
        "fixes": fixes,
    }
    if model_spec:
        report["model"] = {"spec": model_spec, **analyse_model(_load_model(model_spec))}
    return report


def _print_versions(report: dict[str, Any]) -> None:
    print(f"{'package':14} {'installed':12} {'allowed':16} {'tested':22} status")
    for name, v in report["versions"].items():
        if v["tested_floor"]:
            tested = f"{v['tested_floor']} .. {v['tested_newest']}"
        elif v["tested_ci"] != v["tested_newest"]:
            tested = f"{v['tested_ci']}, {v['tested_newest']}"
        else:
            tested = f"{v['tested_newest']} only"
        status = v["status"]
        if status == "newer than tested":
            status += " (allowed, not run by safe_zero's suite yet)"
        elif status == "older than the floor":
            status += f" (refused: pip install '{name}{v['allowed']}')"
        print(f"{name:14} {v['installed'] or '-':12} {v['allowed']:16} {tested:22} {status}")
    for name, v in report["versions"].items():
        if v["newest_green_on"]:
            print(f"{name} {v['tested_newest']}: the whole suite last green on {v['newest_green_on']} "
                  f"(make test-newest; CI runs {v['tested_ci']})")
        if v["spot_checked"]:
            print(f"{name} {', '.join(v['spot_checked'])}: a subset of the suite green (docs/versions.md)")


def _print(report: dict[str, Any]) -> None:
    _print_versions(report)
    print(f"supported DeepSpeed: {report['supported_deepspeed']}; DeepSpeed's own parameter_alignment option: "
          f"{'available (ZeRO-1/2, off unless asked)' if report['deepspeed_parameter_alignment_option'] else 'absent'}")
    print(f"{'fix':28} {'defect here':12} {'engages':8} needed on DeepSpeed")
    for name, fix in report["fixes"].items():
        present = {True: "yes", False: "no", None: "not probed"}[fix["defect_present"]]
        print(f"{name:28} {present:12} {'yes' if fix['engages'] else 'no':8} {fix['needed_on']}")
    model = report.get("model")
    if model:
        print(f"model {model['spec']}:")
        print(f"  zero-sized parameters: {model['zero_sized'] or 'none'}")
        gradless = model["gradless"]
        print(f"  trainable parameters without a gradient: "
              f"{'not checked (no dummy_inputs)' if gradless is None else gradless or 'none'}")
        print(f"  grouped_mm weights: {model['grouped_mm'] or 'none'}")
        print(f"  MoE blocks gathered whole under ZeRO-3 (leaf modules): {model['zero3_leaf_modules'] or 'none'}")
        kept = ", ".join(f"{n} ({size / 2**20:.3g} MiB per rank)" for n, size in model["zero3_kept_gathered"].items())
        print(f"  kept gathered on every rank under ZeRO-3: {kept or 'none'}; modules some ranks skip are found in "
              "the first forward, kept gathered at their full size per rank and named in the initialize report")


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Everything written to stdout goes to stderr inside, also from subprocesses (DeepSpeed's op build, ninja)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        # DeepSpeed's logger holds the original sys.stdout object: empty its buffer while fd 1 is stderr.
        if sys.__stdout__ is not None:  # None where Python runs without a console
            sys.__stdout__.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(as_json: bool, model_spec: str | None) -> int:
    import logging
    import warnings

    if model_spec:
        check_model_spec(model_spec)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if as_json:
        # stdout carries the JSON alone: `doctor --json | jq` must work on a fresh extensions cache too,
        # where DeepSpeed prints its op build on stdout.
        with _stdout_to_stderr():
            report = diagnose(model_spec)
        print(json.dumps(report, indent=2))
    else:
        _print(diagnose(model_spec))
    return 0


__all__ = ["analyse_model", "diagnose", "main"]
