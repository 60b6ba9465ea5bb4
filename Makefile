# Two commands do all the set-up: `make demo` and `make test`.
# torch is pinned to the CPU build that installs offline here; no step but `make test-newest` resolves another torch.
PYTHON      ?= python3
TORCH_PIN   := torch==2.13.0
DS_MAIN     := 0.19.8
DS_LEGACY   := 0.18.9
VENV        := .venv
VENV_LEGACY := .venv-ds$(DS_LEGACY)
VENV_NEWEST := .venv-newest
VENV_FLOOR  := .venv-floor
VENV_DIST   := .venv-dist
EXTRAS      := dev,bench,lightning,accelerate,transformers,examples,trl
# The extras whose floors `make test-floor` installs together (examples and trl need newer transformers).
FLOOR_EXTRAS := lightning,accelerate,transformers
# The exact releases the suite was last seen green on: `make test` installs them, `make lock` rewrites them.
CONSTRAINTS := constraints/ci.txt
PYTEST_ARGS ?=

export DS_ACCELERATOR := cpu

.PHONY: demo test lint dist test-main test-legacy test-newest test-floor lock bench matrix torch-matrix zoo clean

# One JIT build cache per venv: DeepSpeed builds its CPU comm op under the same name for every release.
run_pytest = TORCH_EXTENSIONS_DIR=$(abspath $(1))/torch_extensions $(1)/bin/python -m pytest -q $(PYTEST_ARGS)

$(VENV)/.installed: pyproject.toml Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(TORCH_PIN)
	$(VENV)/bin/pip install -q -c $(CONSTRAINTS) $(TORCH_PIN) deepspeed==$(DS_MAIN) -e '.[$(EXTRAS)]'
	touch $@

# The legacy leg: the core suite on an older DeepSpeed, every other release as pinned for the main leg.
$(VENV_LEGACY)/.installed: pyproject.toml Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV_LEGACY)
	grep -v '^deepspeed==' $(CONSTRAINTS) > $(VENV_LEGACY)/constraints.txt
	$(VENV_LEGACY)/bin/pip install -q $(TORCH_PIN)
	$(VENV_LEGACY)/bin/pip install -q -c $(VENV_LEGACY)/constraints.txt $(TORCH_PIN) deepspeed==$(DS_LEGACY) -e '.[dev]'
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV_LEGACY))/torch_extensions $(VENV_LEGACY)/bin/python -c \
		'from deepspeed.comm.torch import build_shm_op; build_shm_op()'
	touch $@

# The sdist and wheel a user installs, built as `pip wheel .` builds (isolated, the wheel from the sdist) and failed on
# any build warning; the wheel installed (not editable) into a fresh venv, where doctor and a 2-rank ZeRO-3 step run
# from a directory outside the checkout (scripts/dist_smoke.py checks that the installed package is what ran).
# PYTHONDONTWRITEBYTECODE is unset for the build only: setuptools warns that it cannot byte-compile under it. The
# isolated build env takes CI's setuptools pin too (which `make lock` keeps), so a new setuptools cannot fail CI.
dist:
	rm -rf dist $(VENV_DIST)
	$(PYTHON) -m venv $(VENV_DIST)
	$(VENV_DIST)/bin/pip install -q -c $(CONSTRAINTS) build
	env -u PYTHONDONTWRITEBYTECODE PIP_CONSTRAINT=$(abspath $(CONSTRAINTS)) $(VENV_DIST)/bin/python -m build --outdir dist . \
		> $(VENV_DIST)/build.log 2>&1 \
		|| { cat $(VENV_DIST)/build.log; exit 1; }
	@if grep -i warn $(VENV_DIST)/build.log; then echo 'make dist: the build warned (above)'; exit 1; fi
	$(VENV_DIST)/bin/pip install -q $(TORCH_PIN)
	$(VENV_DIST)/bin/pip install -q -c $(CONSTRAINTS) $(TORCH_PIN) deepspeed==$(DS_MAIN) dist/safe_zero-*.whl
	outside=$$(mktemp -d) && cd $$outside && export TORCH_EXTENSIONS_DIR=$(abspath $(VENV_DIST))/torch_extensions && \
		$(abspath $(VENV_DIST))/bin/python -m safe_zero doctor && \
		$(abspath $(VENV_DIST))/bin/python $(abspath scripts/dist_smoke.py) $(CURDIR); \
		status=$$?; rm -rf $$outside; exit $$status

demo: $(VENV)/.installed
	$(VENV)/bin/python -m safe_zero demo

# The legacy leg (its venv and JIT-built comm op first) and then `make dist` run beside the main leg: a leg leaves a
# core idle about a third of the time (its ranks wait on each other), and the two legs' ranks use separate ports and
# shm workspaces. Each target's output is printed whole when it ends.
test: lint
	$(MAKE) -j2 --output-sync=target test-main test-legacy dist

# ruff (pycodestyle, pyflakes, complexity <= 10) and mypy over all of safe_zero/; settings in pyproject.toml.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy

test-main: $(VENV)/.installed
	$(call run_pytest,$(VENV))

# Tests marked main_leg_only check what no DeepSpeed release changes, or what runs on the main leg's only.
test-legacy: $(VENV_LEGACY)/.installed
	$(call run_pytest,$(VENV_LEGACY)) -m 'not main_leg_only'

# The newest releases the registry serves of everything pyproject.toml allows (a fresh venv each time), torch
# included: PyPI's wheel, a CUDA build that runs on CPU (about 3 GB with its libraries; measured 25 s to download
# here). This machine's pip config caps torch at the releases on its disk: this leg lifts that cap.
# `make test-newest TORCH_NEWEST=torch==2.14.1` takes the newest one on disk instead.
TORCH_NEWEST ?= torch
NEWEST_PIP   := PIP_CONSTRAINT=/dev/null $(VENV_NEWEST)/bin/pip
test-newest:
	rm -rf $(VENV_NEWEST)
	$(PYTHON) -m venv $(VENV_NEWEST)
	$(NEWEST_PIP) install -q '$(TORCH_NEWEST)'
	$(NEWEST_PIP) install -q '$(TORCH_NEWEST)' deepspeed -e '.[$(EXTRAS)]'
	$(VENV_NEWEST)/bin/pip freeze --exclude-editable > $(VENV_NEWEST)/resolved.txt
	$(call run_pytest,$(VENV_NEWEST))
	touch $(VENV_NEWEST)/.green

# Every declared floor at once, torch's too (scripts/floors.py reads them from pyproject.toml): PyPI's torch at
# the floor, a CUDA build that runs on CPU (torch 2.4.0: about 3 GB with its libraries).
test-floor:
	rm -rf $(VENV_FLOOR)
	$(PYTHON) -m venv $(VENV_FLOOR)
	$(PYTHON) scripts/floors.py $(FLOOR_EXTRAS) > $(VENV_FLOOR)/floors.txt
	$(VENV_FLOOR)/bin/pip install -q -c $(VENV_FLOOR)/floors.txt torch
	$(VENV_FLOOR)/bin/pip install -q -c $(VENV_FLOOR)/floors.txt torch deepspeed -e '.[dev,$(FLOOR_EXTRAS)]'
	$(VENV_FLOOR)/bin/pip freeze --exclude-editable > $(VENV_FLOOR)/resolved.txt
	$(call run_pytest,$(VENV_FLOOR))

# Pin CI to what `make test-newest` last passed on, but torch: CI keeps the CPU wheel on this disk, without the CUDA
# libraries PyPI's torch brings.
lock: $(VENV_NEWEST)/.green
	{ sed -n '/^#/p' $(CONSTRAINTS); { grep -v -E '^(torch|nvidia-[^=]*|cuda-[^=]*)==' $(VENV_NEWEST)/resolved.txt; \
		grep '^setuptools==' $(CONSTRAINTS); echo '$(TORCH_PIN)'; } | sort -f; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

# Step time against stock in the same rounds: a dated table on top of .bench/RESULTS.md (about half an hour; a
# quick look: BENCH_ARGS="--rows control --stages 2 --rounds 2 --builds 1"). The other costs are tests/benchmarks.
BENCH_ARGS ?=
bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/run.py $(BENCH_ARGS)

matrix:
	$(PYTHON) scripts/matrix.py

# A subset of the suite on the torch releases between the floor and CI's (scripts/torch_matrix.py says which).
torch-matrix:
	$(PYTHON) scripts/torch_matrix.py

# Every architecture the installed transformers ships, stock and safe_zero, ZeRO-2/3: writes docs/zoo.md (CI runs a
# subset, tests/zoo/test_zoo.py). Rows already measured on the same versions are kept in .zoo/ (ZOO_ARGS=--fresh).
ZOO_ARGS ?=
zoo: $(VENV)/.installed
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(VENV)/bin/python -m tests.zoo $(ZOO_ARGS)

clean:
	rm -rf $(VENV) $(VENV_LEGACY) $(VENV_NEWEST) $(VENV_FLOOR) $(VENV_DIST) dist .venv-matrix .pytest_cache .zoo
