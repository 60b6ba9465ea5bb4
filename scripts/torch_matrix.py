"""``make torch-matrix``: a subset of the suite on the torch releases clusters pin, between the floor and CI's.

For each release: ``.venv-matrix/torch-<release>`` with PyPI's torch (a CUDA build that runs on CPU, about 3 GB
with its libraries), DeepSpeed 0.19.8 and safe_zero's core (not CI's constraints: an older torch pins its own
triton and sympy); ``python -m safe_zero doctor --json`` (what stock DeepSpeed does there) and one pytest session
over ``TESTS``: each fix's own tests, and the tests of what reaches into torch internals beyond them (the
uneven-input ``Join``, the JIT build lock, grouped_mm alignment). The floor runs the whole suite in
``make test-floor``, CI's 2.13.0 in ``make test``.

Prints the table (release x fix -> stock, safe_zero) and writes it into docs/versions.md between the ``torch-matrix``
markers. Exit status 1 if any test failed.

    make torch-matrix                                   # every release below
    TORCH_MATRIX_RELEASES="2.6.0" make torch-matrix     # a subset
    MATRIX_REUSE=1 make torch-matrix                    # keep the rows already measured at this commit
"""

from __future__ import annotations

import os
import sys
import time

import matrix

RELEASES = os.environ.get("TORCH_MATRIX_RELEASES", "2.5.1 2.6.0 2.8.0 2.10.0").split()
DEEPSPEED = "0.19.8"
TESTS = [*matrix._fix_test_files(), "tests/test_uneven_inputs.py", "tests/test_op_builds.py",
         "tests/test_alignment.py"]
START, END = "<!-- torch-matrix:start -->", "<!-- torch-matrix:end -->"
OTHER = "uneven inputs, build lock, alignment"


def _measure(release: str) -> dict[str, str]:
    name = f"torch-{release}"
    python = matrix._venv(name, f"torch=={release}", [f"deepspeed=={DEEPSPEED}", "-e", ".[dev]"])
    return matrix._row(python, TESTS)


def main() -> int:
    started = time.time()
    rows: dict[str, dict[str, str]] = {}
    for release in RELEASES:
        rows[release] = matrix._kept_row(f"torch-{release}", lambda: _measure(release))
        print(f"torch {release}: {rows[release]}", flush=True)
        # Written after every release, so an interrupted run still leaves what it measured.
        table = matrix._table(rows, (time.time() - started) / 60, axis="torch",
                              ran_on=f"DeepSpeed {DEEPSPEED}, PyPI's torch builds", other=OTHER)
        matrix._write_readme(table, START, END)
    print(table)
    return 1 if matrix.broken(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
