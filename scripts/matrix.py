"""``make matrix``: the fix tests against every DeepSpeed release where behaviour changed.

For each release: a virtual environment (torch pinned to the CPU build), ``python -m safe_zero
doctor --json`` for what stock does (probes), and each fix's own tests (``tests/fixes/test_<fix
module>.py``, which assert the stock error where the release has the defect and that safe_zero
passes). Prints a Markdown table (release x fix -> stock, safe_zero) and writes it to
``scripts/matrix.md`` for the README.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASES = os.environ.get("MATRIX_RELEASES", "0.18.0 0.18.9 0.19.0 0.19.6 0.19.7 0.19.8").split()
TORCH_PIN = "torch==2.13.0"


def _sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)


def _venv(release: str) -> str | None:
    venv = os.path.join(ROOT, ".venv-matrix", f"ds-{release}")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, ".installed")):
        steps = [[sys.executable, "-m", "venv", venv],
                 [python, "-m", "pip", "install", "-q", TORCH_PIN],
                 [python, "-m", "pip", "install", "-q", TORCH_PIN, f"deepspeed=={release}", "-e", ".[dev]"]]
        for step in steps:
            if _sh(step).returncode != 0:
                return None
        open(os.path.join(venv, ".installed"), "w").close()
    return python


def _fix_modules() -> dict[str, str]:
    """fix module stem -> its test file (tests mirror the package)."""
    stems = [os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "safe_zero", "fixes", "*.py"))
             if not os.path.basename(p).startswith("_")]
    return {s: f"tests/fixes/test_{s}.py" for s in sorted(stems) if os.path.exists(os.path.join(ROOT, "tests", "fixes", f"test_{s}.py"))}


def _row(release: str) -> dict[str, str]:
    python = _venv(release)
    if python is None:
        return {"*": "install failed"}
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": os.path.join(os.path.dirname(os.path.dirname(python)), "torch_extensions")}
    doctor = _sh([python, "-m", "safe_zero", "doctor", "--json"], env=env)
    if doctor.returncode != 0:
        return {"*": "import failed: " + (doctor.stderr.strip().splitlines() or ["?"])[-1][:80]}
    fixes = json.loads(doctor.stdout[doctor.stdout.index("{"):])["fixes"]
    cells = {}
    for stem, test_file in _fix_modules().items():
        module = _sh([python, "-c", f"import safe_zero.fixes.{stem} as m; print(m.FIX.name)"], env=env)
        name = module.stdout.strip()
        probe = fixes.get(name, {})
        stock = {True: "defect", False: "ok", None: "-"}[probe.get("defect_present")]
        tests = _sh([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file], env=env)
        summary = (re.findall(r"(\d+ passed.*|\d+ failed.*)", tests.stdout) or ["no result"])[-1]
        safe = ("pass" if tests.returncode == 0 else "FAIL") + f" ({summary.split(' in ')[0]})"
        cells[name] = f"stock: {stock}; fix {'on' if probe.get('engages') else 'off'}; tests {safe}"
    return cells


def main() -> int:
    rows = {release: _row(release) for release in RELEASES}
    names = sorted({name for cells in rows.values() for name in cells if name != "*"})
    lines = ["| DeepSpeed | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for release, cells in rows.items():
        lines.append(f"| {release} | " + " | ".join(cells.get(n, cells.get("*", "-")) for n in names) + " |")
    table = "\n".join(lines)
    with open(os.path.join(ROOT, "scripts", "matrix.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0 if all("FAIL" not in c and "failed" not in c for cells in rows.values() for c in cells.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
