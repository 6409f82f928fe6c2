#!/usr/bin/env bash
# Rollout engines side by side in a short GRPO run: hf (TP=1), megatron (TP=1), megatron (TP=2, 2 GPUs).
#   bash bench/rollout_engines.sh SMOLLM2_DIR DATA_DIR OUT
# SMOLLM2_DIR: SmolLM2-135M-Instruct's config and tokenizer (weights are not read: the model is its shape
# with 12 query / 4 KV heads, so that TP=2 splits it, randomly initialised; responses run to the limit).
# DATA_DIR: `grpo prepare` output. Prints a table per step last; metrics under OUT/<run>/metrics.jsonl.
set -euo pipefail
src=$1 data=$2 out=$3
mkdir -p "$out"
python3 bench/random_hf_model.py --model "$src" --heads 12 4 "$out/model"
run() {  # name, overrides...
  name=$1; shift
  python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_gpu.yaml actor_rollout_ref.model.path="$out/model" \
    data.train_files="[$data/train.parquet]" data.val_files="[$data/test.parquet]" \
    trainer.default_local_dir="$out/$name" trainer.resume_mode=disable trainer.total_training_steps=3 \
    trainer.save_freq=-1 trainer.logger=[console] "$@" > "$out/$name.log" 2>&1 || echo "$name failed: $(tail -3 "$out/$name.log")"
}
run hf_tp1
run megatron_tp1 actor_rollout_ref.rollout.name=megatron
run megatron_tp2 actor_rollout_ref.rollout.name=megatron trainer.n_gpus_per_node=2 \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
  actor_rollout_ref.actor.megatron.sequence_parallel=false +trainer.env.NCCL_NVLS_ENABLE=0
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| run | step | gen s | tokens/s/GPU | resp len | logprob diff max | step s | peak GiB |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for name in ("hf_tp1", "megatron_tp1", "megatron_tp2"):
    path = out / name / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    for r in rows or [{"step": "failed"}]:
        if "timing/gen" not in r:
            print(f"| {name} | failed | | | | | | |")
            continue
        print(
            f"| {name} | {r['step']} | {r['timing/gen']:.2f} | {r['perf/throughput']:.0f} | "
            f"{r['response/length_mean']:.0f} | {r['rollout/log_prob_diff_max']:.2e} | {r['timing/step']:.2f} | "
            f"{r.get('perf/max_memory_gib', 0):.1f} |"
        )
PY
