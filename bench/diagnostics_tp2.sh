#!/usr/bin/env bash
# Run diagnostics on two GPUs: a short GRPO run at TP=2 with step 2 profiled, then a table of the GPU
# utilisation and the share of time in collectives per phase.
#   bash bench/diagnostics_tp2.sh MODEL_DIR DATA_DIR OUT
# MODEL_DIR: SmolLM2-135M-Instruct as a Hugging Face directory (only its config and tokenizer are read);
# DATA_DIR: `grpo prepare` output. SmolLM2-135M's 9 query / 3 KV heads do not split over TP=2, so the run
# uses its shape with 12 query / 4 KV heads (head_dim 48, the same parameter count), randomly initialised:
# the profile measures the work, not what the model says (responses run to max_response_length).
# Under OUT: model_tp2/ (that model), run/ (metrics.jsonl, profile/step_000002.json, tensorboard/, launch logs).
set -euo pipefail
model=$1 data=$2 out=$3
mkdir -p "$out"
python3 bench/random_hf_model.py --model "$model" --heads 12 4 "$out/model_tp2"
python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_gpu.yaml \
  actor_rollout_ref.model.path="$out/model_tp2" data.train_files="[$data/train.parquet]" \
  data.val_files="[$data/test.parquet]" trainer.default_local_dir="$out/run" trainer.resume_mode=disable \
  trainer.n_gpus_per_node=2 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
  trainer.total_training_steps=3 trainer.save_freq=-1 trainer.profile_steps=[2] \
  trainer.logger=[console,tensorboard] +trainer.env.NCCL_NVLS_ENABLE=0
python3 - "$out/run/metrics.jsonl" <<'PY'
import json, sys

rows = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
profiled, last = rows[2], rows[max(rows)]
n = last["step"]


def cell(row, key, fmt):
    return format(row[key], fmt) if key in row else "–"


print(f"| phase | seconds (step {n}) | GPU util % (step {n}) | GPU util % (step 2, profiled) | in collectives (step 2) |")
print("| --- | --- | --- | --- | --- |")
phases = [k.removeprefix("timing/") for k in last if k.startswith("timing/") and k != "timing/step"]
for p in phases:
    print(
        f"| {p} | {cell(last, f'timing/{p}', '.2f')} | {cell(last, f'gpu/util_{p}', '.0f')} "
        f"| {cell(profiled, f'gpu/util_{p}', '.0f')} | {cell(profiled, f'profile/comm_share_{p}', '.1%')} |"
    )
print(f"| step | {cell(last, 'timing/step', '.2f')} | | | {cell(profiled, 'profile/comm_share', '.1%')} |")
print(f"\npeak GPU memory used (NVML, step {n}): {cell(last, 'gpu/memory_used_gib_max', '.1f')} GiB")
PY
