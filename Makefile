# Two commands do all the set-up: `make demo` and `make test`.
# torch is pinned to the CPU build that installs offline here; no step may resolve another torch.
PYTHON      ?= python3
TORCH_PIN   := torch==2.13.0
DS_MAIN     := 0.19.8
DS_LEGACY   := 0.18.9
VENV        := .venv
VENV_LEGACY := .venv-ds$(DS_LEGACY)
EXTRAS      := dev,lightning,accelerate,transformers,examples,trl
PYTEST_ARGS ?=

export DS_ACCELERATOR := cpu
# One JIT build cache per venv: DeepSpeed builds its CPU comm op under the same name for every release.
export TORCH_EXTENSIONS_DIR = $(abspath $(VENV))/torch_extensions

.PHONY: demo test test-main test-legacy bench matrix clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(TORCH_PIN)
	$(VENV)/bin/pip install -q $(TORCH_PIN) deepspeed==$(DS_MAIN) -e '.[$(EXTRAS)]'
	touch $@

$(VENV_LEGACY)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_LEGACY)
	$(VENV_LEGACY)/bin/pip install -q $(TORCH_PIN)
	$(VENV_LEGACY)/bin/pip install -q $(TORCH_PIN) deepspeed==$(DS_LEGACY) -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python -m safe_zero demo

test: test-main test-legacy

test-main: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

test-legacy: $(VENV_LEGACY)/.installed
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV_LEGACY))/torch_extensions $(VENV_LEGACY)/bin/python -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/run.py

matrix:
	$(PYTHON) scripts/matrix.py

clean:
	rm -rf $(VENV) $(VENV_LEGACY) .venv-matrix .pytest_cache
