#!/usr/bin/env bash
# Issue 37's benchmark, one GPU call: a Qwen2.5-7B-shaped GRPO step with LoRA rank 64 (alpha 128, every linear
# layer) through `grpo train` on one card, and TRL's GRPOTrainer with peft on the same work (bench/trl_peer.py
# --lora-rank 64, gradient checkpointing off: its fastest that fits); with STAGES=small, the 1.5B step with LoRA
# against the full-parameter one instead. Random weights, SmolLM2's tokenizer, 64 GSM8K prompts x 8 samples x 256
# tokens a step, KL to the reference (with LoRA: the base, adapters off).
#   bash bench/gpu_call.sh bench/lora_vs_trl.sh          (after bench/gpu_carry.sh here; STAGES=small for the 1.5B)
# Stages stop at BUDGET_S seconds (default 570). Tokens/s per GPU and peak memory by step, a table last.
set -uo pipefail
tok=$1 src=$2 out=$3 work=${WORK:-/tmp/bench-work} budget=${BUDGET_S:-570}
data=$work/gsm8k
mkdir -p "$out" "$work"
left() { local l=$((budget - SECONDS)); echo $((l > 1 ? l : 1)); }
[ -f "$data/train.parquet" ] || python3 -m grpo_core.cli prepare --source "$src" --output "$data" > /dev/null || exit 1
lora=(actor_rollout_ref.model.lora.rank=64 actor_rollout_ref.model.lora.alpha=128
  actor_rollout_ref.model.lora.target_modules=all-linear)
run() {  # NAME MODEL STEPS OVERRIDES...
  local name=$1 model=$2 steps=$3; shift 3
  [ -d "$work/$model" ] || python3 bench/random_hf_model.py --model "Qwen/$model" --tokenizer "$tok" "$work/$model" > /dev/null
  echo "[$SECONDS s] $name"
  timeout "$(left)" python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_gpu.yaml \
    actor_rollout_ref.model.path="$work/$model" data.train_files="[$data/train.parquet]" \
    data.val_files="[$data/test.parquet]" data.train_batch_size=64 actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${TOKENS:-8192}" \
    actor_rollout_ref.rollout.name=static actor_rollout_ref.rollout.max_num_seqs=512 \
    trainer.default_local_dir="$work/$name" trainer.resume_mode=disable trainer.total_training_steps="$steps" \
    trainer.save_freq=-1 trainer.logger=[console] "$@" ${EXTRA:-} > "$out/$name.log" 2>&1 \
    || echo "$name failed: $(grep '^error' "$out/$name.log" | tail -2)"
  mkdir -p "$out/$name" && cp "$work/$name/metrics.jsonl" "$out/$name/" 2>/dev/null
}
trl() {  # NAME MODEL ARGS...
  local name=$1 model=$2; shift 2
  echo "[$SECONDS s] $name"
  timeout "$(left)" python3 bench/trl_peer.py "$work/$model" "$data" "$out/$name.json" "$@" > "$out/$name.log" 2>&1 \
    || echo "$name failed: $(tail -2 "$out/$name.log")"
}
if [ "${STAGES:-7b}" = small ]; then
  run qwen1.5b_lora64 Qwen2.5-1.5B 4 "${lora[@]}"
  run qwen1.5b_full Qwen2.5-1.5B 4
else
  run qwen7b_lora64 Qwen2.5-7B 3 "${lora[@]}"
  trl trl_qwen7b_lora64 Qwen2.5-7B --steps 2 --lora-rank 64
fi
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("| implementation | step | step s | tokens/s/GPU | peak GiB |")
print("| --- | --- | --- | --- | --- |")
for metrics in sorted(out.glob("*/metrics.jsonl")):
    for r in map(json.loads, metrics.read_text().splitlines()):
        if "timing/step" in r:
            print(f"| project, {metrics.parent.name} | {r['step']} | {r['timing/step']:.2f} | "
                  f"{r['perf/throughput']:,.0f} | {r.get('perf/max_memory_gib', 0):.1f} |")
for peer in sorted(out.glob("trl_*.json")):
    trl = json.loads(peer.read_text())
    for s in trl["steps"]:
        print(f"| {trl['implementation']} | {s['step']} | {s['seconds']:.2f} | {s['tokens_per_s_per_gpu']:,.0f} | "
              f"{trl['peak_gib']:.1f} |")
PY
