# Set-up, demo and tests. Everything installs into .venv at the repo root.
#   make demo   set up, then run the main job on the embedded default (CPU, no network)
#   make test   set up, then lint and run the test suite (what CI runs)
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean

setup: $(STAMP)

# torch first, pinned, so that the wheel for this machine is used instead of whatever a dependency
# would pull; GPU machines override TORCH (e.g. TORCH=torch==2.13.0 from the CUDA index).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(BIN)/grpo prepare --source embedded --output data/gsm8k
	$(BIN)/grpo train --config configs/demo_cpu.yaml --dry-run

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) data/gsm8k
