"""``make matrix``: the core test suite against every DeepSpeed release where behaviour changed.

For each release: a virtual environment with that DeepSpeed and safe_zero's core (torch pinned to
the CPU build, no Lightning/Accelerate/Transformers, so their tests skip as in CI's legacy leg),
``python -m safe_zero doctor --json`` for what stock does there (the probes run stock DeepSpeed),
and one pytest session over ``tests/``. Each fix's own tests (``tests/fixes/test_<fix module>.py``)
assert the stock error where the release has the defect and that safe_zero passes; the rest of
the suite is reported as one column.

Prints a Markdown table (release x fix -> stock, safe_zero) and writes it into docs/versions.md between the
``matrix`` markers. Exit status 1 if any test failed.

    make matrix                                  # every release below
    MATRIX_RELEASES="0.19.0 0.19.8" make matrix  # a subset
    MATRIX_REUSE=1 make matrix                   # keep the rows already measured at this commit

Each release's row is kept in ``.venv-matrix/ds-<release>/row.json`` with the commit it ran at.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Callable

from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASES = os.environ.get("MATRIX_RELEASES", "0.18.3 0.18.9 0.19.0 0.19.6 0.19.7 0.19.8").split()
TORCH_PIN = "torch==2.13.0"
README_START, README_END = "<!-- matrix:start -->", "<!-- matrix:end -->"
MATRIX_DOC = os.path.join("docs", "versions.md")  # where the table is shown, between those markers
OTHER = "rest of the core suite"


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)


def _venv(name: str, torch: str, requirements: list[str]) -> str | None:
    """``.venv-matrix/<name>``'s python, with ``torch`` installed first, then it again with ``requirements``."""
    venv = os.path.join(ROOT, ".venv-matrix", name)
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, ".installed")):
        steps = [[sys.executable, "-m", "venv", venv],
                 [python, "-m", "pip", "install", "-q", torch],
                 [python, "-m", "pip", "install", "-q", torch, *requirements]]
        for step in steps:
            if _sh(step).returncode != 0:
                return None
        open(os.path.join(venv, ".installed"), "w").close()
    return python


def _fix_test_files() -> dict[str, str]:
    """test file (relative) -> fix module stem; tests mirror the package."""
    stems = [os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "safe_zero", "fixes", "*.py"))
             if not os.path.basename(p).startswith("_")]
    return {f"tests/fixes/test_{s}.py": s for s in sorted(stems)
            if os.path.exists(os.path.join(ROOT, "tests", "fixes", f"test_{s}.py"))}


def _outcomes(junit: str) -> dict[str, collections.Counter]:
    """test file -> Counter of passed / failed / xfailed / skipped, from pytest's JUnit XML."""
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case in ET.parse(junit).getroot().iter("testcase"):
        # classname: the test module, dotted, then any TestClass; a module skipped at collection has it as its name.
        parts = (case.get("classname") or case.get("name", "")).split(".")
        module_end = next(i for i, part in enumerate(parts) if part.startswith("test_")) + 1
        path = "/".join(parts[:module_end]) + ".py"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif (skipped := case.find("skipped")) is not None:
            outcome = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            outcome = "passed"
        per_file[path][outcome] += 1
    return per_file


def _counts(counter: collections.Counter) -> str:
    shown = ("passed", "failed", "xfailed", "skipped")
    return ", ".join(f"{counter[k]} {k}" for k in shown if counter[k]) or "none ran"


def _commit() -> str:
    head = _sh(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
    # The files this script writes do not count as changes to what it measured.
    dirty = _sh(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{MATRIX_DOC}"]).stdout.strip()
    return head + ("+changes" if dirty else "")


def _kept_row(name: str, run: Callable[[], dict[str, str]]) -> dict[str, str]:
    """The row of ``.venv-matrix/<name>``: reused if ``MATRIX_REUSE`` is set and it was measured at this commit, else
    ``run()``."""
    path = os.path.join(ROOT, ".venv-matrix", name, "row.json")
    commit = _commit()
    if os.environ.get("MATRIX_REUSE") and os.path.exists(path):
        kept = json.load(open(path))
        if kept["commit"] == commit and "+changes" not in commit:
            return kept["cells"]
    cells = run()
    if os.path.isdir(os.path.dirname(path)):
        with open(path, "w") as f:
            json.dump({"commit": commit, "cells": cells}, f)
    return cells


def _row(python: str | None, tests: list[str]) -> dict[str, str]:
    """Doctor's probes and one pytest session over ``tests`` in the venv of ``python``: a cell per fix, one for the
    rest."""
    if python is None:
        return {"*": "install failed"}
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": os.path.join(os.path.dirname(os.path.dirname(python)), "torch_extensions")}
    doctor = _sh([python, "-m", "safe_zero", "doctor", "--json"], env=env)
    if doctor.returncode != 0:
        return {"*": "import failed: " + (doctor.stderr.strip().splitlines() or ["?"])[-1][:80]}
    fixes = json.loads(doctor.stdout[doctor.stdout.index("{"):])["fixes"]
    junit = os.path.join(os.path.dirname(os.path.dirname(python)), "junit.xml")
    _sh([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests], env=env)
    if not os.path.exists(junit):
        return {"*": "pytest did not run"}
    per_file = _outcomes(junit)
    os.remove(junit)
    cells, other = {}, collections.Counter()
    fix_files = _fix_test_files()
    for path, counter in per_file.items():
        if path not in fix_files:
            other += counter
    for path, stem in fix_files.items():
        name = _sh([python, "-c", f"import safe_zero.fixes.{stem} as m; print(m.FIX.name)"], env=env).stdout.strip()
        probe = fixes.get(name, {})
        stock = {True: "defect", False: "no defect", None: "not probed"}[probe.get("defect_present")]
        switch = "on" if probe.get("engages") else "off"
        cells[name] = f"{stock} / {switch}: {_counts(per_file.get(path, collections.Counter()))}"
    cells[OTHER] = _counts(other)
    return cells


def _write_readme(table: str, start: str = README_START, end: str = README_END) -> None:
    path = os.path.join(ROOT, MATRIX_DOC)
    text = open(path).read()
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + start + "\n" + table + "\n" + end + rest.split(end, 1)[1]
        with open(path, "w") as f:
            f.write(text)


def _table(rows: dict[str, dict[str, str]], minutes: float, axis: str = "DeepSpeed",
           ran_on: str = "torch 2.13.0 CPU build", other: str = OTHER) -> str:
    names = sorted({name for cells in rows.values() for name in cells if name not in ("*", OTHER)}) + [OTHER]
    lines = [f"| {axis} | " + " | ".join(f"`{n}`" if n != OTHER else other for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for release, cells in sorted(rows.items(), key=lambda item: Version(item[0])):
        lines.append(f"| {release} | " + " | ".join(cells.get(n, cells.get("*", "-")) for n in names) + " |")
    lines += ["", "Each fix cell: what stock DeepSpeed does (`safe_zero doctor` probe) / whether the fix is on "
              "(`auto`) : that fix's tests, which assert the stock error where the release has the defect and "
              "that safe_zero trains. Skipped tests need Lightning/Accelerate/Transformers (not installed here) "
              "or a route this release does not have.",
              f"Run on {platform.machine()}, {os.cpu_count()} CPUs, {ran_on}, CPU/gloo, {minutes:.0f} min."]
    return "\n".join(lines)


def main() -> int:
    started = time.time()
    rows: dict[str, dict[str, str]] = {}
    for release in RELEASES:
        rows[release] = _kept_row(f"ds-{release}", lambda: _row(
            _venv(f"ds-{release}", TORCH_PIN, [f"deepspeed=={release}", "-e", ".[dev]"]), ["tests"]))
        print(f"DeepSpeed {release}: {rows[release]}", flush=True)
        # Written after every release, so an interrupted run still leaves what it measured.
        table = _table(rows, (time.time() - started) / 60)
        _write_readme(table)
    print(table)
    return 1 if broken(rows) else 0


def broken(rows: dict[str, dict[str, str]]) -> bool:
    """Whether a test failed, or a release did not install, import or run, in any row."""
    failed = re.compile(r"\d+ failed|install failed|import failed|did not run|none ran")
    return any(failed.search(c) for cells in rows.values() for c in cells.values())


if __name__ == "__main__":
    sys.exit(main())
