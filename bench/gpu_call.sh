#!/usr/bin/env bash
# The GPU machine's side of a benchmark call (after bench/gpu_carry.sh here): the carried wheels installed beside
# the machine's torch, then a bench script given the carried tokenizer and GSM8K, its results under OUT.
#   bash bench/gpu_call.sh bench/grpo_vs_trl.sh     (RUNS, EXTRA, BUDGET_S... pass through to the script)
# grpo_vs_trl.sh runs the project's step and TRL's GRPOTrainer in one call, each step against its lower bound.
set -uo pipefail
carry=${CARRY:-.carry} out=${OUT:-/tmp/bench-out}
python3 -m pip install --quiet --no-index --no-deps --target /tmp/carried "$carry"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/carried:$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"  # launch-bound phases follow it
python3 -c "from importlib.metadata import version as v; print(*(f'{p} {v(p)}' for p in ('torch', 'transformers', \
'megatron-core', 'trl')), sep=' | ')"
bash "$@" "$carry/tok" "$carry/gsm8k_src" "$out"
