#!/usr/bin/env python3
"""Run an upstream (peer) test suite stock and with safe_zero installed, and compare outcomes per test.

    DS_ACCELERATOR=cpu nice -n 15 python scripts/peer_suites.py \\
        --suite-dir /tmp/up/lightning/tests --python .venv/bin/python \\
        tests_pytorch/strategies/test_deepspeed.py tests_fabric/strategies/test_deepspeed.py

Test paths are relative to --suite-dir, which is also the working directory and pytest's --rootdir.
Both runs get PYTHONPATH=<temp dir holding a sitecustomize.py>; only the safe run sets
SAFE_ZERO_INSTALL=1, which makes that sitecustomize call ``safe_zero.install()`` in every Python
process (pytest workers and launched subprocesses included). Junit xml and logs of both runs go to
--out-dir. Prints outcome counts and every test whose outcome differs; --recheck reruns each
difference alone, both ways. Exit code 1 if any outcome differs, 2 if a run could not be read.
Stdlib only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SITECUSTOMIZE = """\
import os
if os.environ.get("SAFE_ZERO_INSTALL") == "1":
    import safe_zero
    safe_zero.install()
"""

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
MODES = ("stock", "safe")
SEVERITY = {"passed": 0, "skipped": 1, "xfailed": 2, "failed": 3, "error": 4}


class Result:
    """One test's outcome and, when it did not pass, the first lines of why."""

    def __init__(self, outcome: str, text: str = "") -> None:
        self.outcome = outcome
        self.text = text


def parse_junit(path: Path) -> dict[str, Result]:
    """Map pytest node id -> Result from a junit xml written with ``-o junit_family=xunit1``."""
    results: dict[str, Result] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or ""
        classname = case.get("classname") or ""
        name = case.get("name") or ""
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file.replace("/", ".")
        if not classname:  # collection error: name is the mangled module path
            nodeid = file or name
        elif classname == module or classname.startswith(module + "."):
            classes = [c for c in classname[len(module):].split(".") if c]
            nodeid = "::".join([file, *classes, name])
        else:
            nodeid = f"{classname}::{name}"
        outcome, text = "passed", ""
        for tag in ("error", "failure", "skipped"):
            el = case.find(tag)
            if el is None:
                continue
            outcome = {"error": "error", "failure": "failed"}.get(tag, "skipped")
            if tag == "skipped" and (el.get("type") or "") == "pytest.xfail":
                outcome = "xfailed"
            text = ((el.get("message") or "") + "\n" + (el.text or "")).strip()
            break
        prev = results.get(nodeid)
        if prev is None or SEVERITY[outcome] > SEVERITY[prev.outcome]:
            results[nodeid] = Result(outcome, text)
    return results


def pytest_has_timeout(python: str) -> bool:
    return subprocess.run([python, "-c", "import pytest_timeout"], capture_output=True).returncode == 0


def run_pytest(args: argparse.Namespace, site_dir: Path, mode: str, tests: list[str], junit: Path,
               log: Path) -> tuple[int, float]:
    """Run pytest once in ``mode``; return (exit code, wall seconds)."""
    env = dict(os.environ)
    env.pop("SAFE_ZERO_INSTALL", None)
    if mode == "safe":
        env["SAFE_ZERO_INSTALL"] = "1"
    paths = [str(site_dir), *args.pythonpath]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [args.python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
           f"--rootdir={args.suite_dir}", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if args.timeout and pytest_has_timeout(args.python):
        cmd.append(f"--timeout={args.timeout}")
    cmd += [*args.pytest_arg, *tests]
    start = time.monotonic()
    with open(log, "w") as fh:
        fh.write(f"# {mode}: SAFE_ZERO_INSTALL={env.get('SAFE_ZERO_INSTALL', '')} "
                 f"PYTHONPATH={env['PYTHONPATH']}\n# {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, cwd=args.suite_dir, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    return rc, time.monotonic() - start


def first_lines(text: str, n: int) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join("      " + ln[:200] for ln in lines[:n])


def compare(stock: dict[str, Result], safe: dict[str, Result]) -> list[str]:
    return sorted(t for t in stock.keys() | safe.keys()
                  if (stock[t].outcome if t in stock else "missing") != (safe[t].outcome if t in safe else "missing"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite-dir", required=True, type=lambda s: str(Path(s).resolve()),
                   help="extracted upstream tests dir (cwd and --rootdir of pytest)")
    # abspath, not resolve: a venv's python is a symlink whose target is outside the venv.
    p.add_argument("--python", default=sys.executable, type=os.path.abspath, help="python of the venv to test in")
    p.add_argument("--out-dir", default=None, help="where junit xml and logs go (default: a new temp dir)")
    p.add_argument("--timeout", type=int, default=300, help="per-test timeout if pytest-timeout is installed; 0: none")
    p.add_argument("--pythonpath", action="append", default=[], help="extra PYTHONPATH entry (repeatable)")
    p.add_argument("--pytest-arg", action="append", default=[], help="extra pytest argument (repeatable)")
    p.add_argument("--recheck", action="store_true", help="rerun each differing test alone, stock and safe")
    p.add_argument("--lines", type=int, default=8, help="lines of safe-side error text per difference")
    p.add_argument("tests", nargs="+", help="test paths / node ids, relative to --suite-dir")
    args = p.parse_args()

    out = Path(args.out_dir or tempfile.mkdtemp(prefix="peer_suites-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    site_dir = Path(tempfile.mkdtemp(prefix="sz-site-"))
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)

    results: dict[str, dict[str, Result]] = {}
    for mode in MODES:
        junit, log = out / f"{mode}.xml", out / f"{mode}.log"
        rc, wall = run_pytest(args, site_dir, mode, args.tests, junit, log)
        print(f"{mode:5s}: pytest exit {rc}, {wall:.0f}s wall, junit {junit}, log {log}", flush=True)
        if not junit.exists():
            print(f"{mode}: no junit xml written; see {log}", file=sys.stderr)
            return 2
        results[mode] = parse_junit(junit)

    stock, safe = results["stock"], results["safe"]
    print(f"\n{'outcome':10s}{'stock':>8s}{'safe':>8s}")
    for o in OUTCOMES:
        a = sum(r.outcome == o for r in stock.values())
        b = sum(r.outcome == o for r in safe.values())
        print(f"{o:10s}{a:8d}{b:8d}")
    print(f"{'total':10s}{len(stock):8d}{len(safe):8d}")

    diffs = compare(stock, safe)
    print(f"\n{len(diffs)} test(s) with differing outcomes")
    for i, t in enumerate(diffs):
        s = stock[t].outcome if t in stock else "missing"
        z = safe[t] if t in safe else Result("missing")
        print(f"  {t}\n    stock={s} safe={z.outcome}")
        if z.text:
            print(first_lines(z.text, args.lines))
        if args.recheck:
            again = {}
            for mode in MODES:
                junit = out / "recheck" / f"{i:03d}-{mode}.xml"
                junit.parent.mkdir(exist_ok=True)
                run_pytest(args, site_dir, mode, [t], junit, junit.with_suffix(".log"))
                r = parse_junit(junit).get(t) if junit.exists() else None
                again[mode] = r.outcome if r else "missing"
            verdict = "REPRODUCES" if (again["stock"], again["safe"]) == (s, z.outcome) else (
                "same both ways alone (noise?)" if again["stock"] == again["safe"] else "differs differently")
            print(f"    recheck alone: stock={again['stock']} safe={again['safe']} -> {verdict}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
