#!/usr/bin/env bash
# One GPU call: the project's GRPO step (bench/grpo_step.sh: 16-row, 8,192-token or larger-budget micro-batches)
# and TRL's GRPOTrainer on the same checkpoint and work (bench/trl_peer.py), every step against its computed lower bound
# (bench/step_limit.py, ceilings measured in the same call); then, time allowing, SmolLM2-135M-shaped costs for
# sizing a long run (bench/eval_static.py on 1,319 questions, a few training steps, a checkpoint and its export).
#   bash bench/grpo_vs_trl.sh TOKENIZER_DIR GSM8K_SOURCE OUT   (GSM8K_SOURCE: what `grpo prepare --source` takes,
#   or its output)
# Needs trl and datasets beside the project's packages. Stages stop at BUDGET_S seconds (default 560); RUNS picks
# grpo_step.sh's runs (RUNS=large: the fastest measured), SIZING=0 skips the SmolLM2 sizing, PEER=0 skips TRL
# (a re-measure of our own step only).
set -uo pipefail
tok=$1 src=$2 out=$3 work=${WORK:-/tmp/bench-work} budget=${BUDGET_S:-560}
data=$work/gsm8k model=$work/Qwen2.5-1.5B
mkdir -p "$out" "$work"
left() { local l=$((budget - SECONDS)); echo $((l > 1 ? l : 1)); }  # timeout refuses 0 and negatives
stamp() { echo "[$SECONDS s] $*"; }
if [ -f "$src/train.parquet" ]; then data=$src  # already prepared
else python3 -m grpo_core.cli prepare --source "$src" --output "$data" > /dev/null || exit 1; fi

stamp "project: bench/grpo_step.sh"
bash bench/grpo_step.sh "$tok" "$data" "$out"
echo "recompile-limit warnings: $(cat "$out"/*.log | grep -c recompile_limit)"

if [ "${PEER:-1}" = 1 ]; then
  stamp "TRL GRPOTrainer"
  timeout "$(left)" python3 bench/trl_peer.py "$model" "$data" "$out/trl.json" --steps 3 > "$out/trl.log" 2>&1 \
    || echo "trl failed: $(tail -3 "$out/trl.log")"
fi

stamp "limits"
python3 bench/step_limit.py --measure --n 8 --model "$model" "$out"/*/metrics.jsonl --json "$out/limit.json" \
  | tee "$out/limit.md"

if [ "${SIZING:-1}" = 1 ] && [ "$(left)" -gt 150 ]; then
  stamp "SmolLM2-135M-shaped sizing (random weights: every answer runs to its limit)"
  smol=$work/smollm2_random
  [ -d "$smol" ] || python3 bench/random_hf_model.py --model "$tok" "$smol"
  timeout "$(left)" python3 bench/eval_static.py "$smol" "$data/test.parquet" "$out/smol_eval" | tail -1
  stamp "SmolLM2-shaped eval done"
  timeout "$(left)" python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_static.yaml \
    actor_rollout_ref.model.path="$smol" data.train_files="[$data/train.parquet]" data.val_files="[$data/test.parquet]" \
    trainer.default_local_dir="$work/smol_run" trainer.resume_mode=disable trainer.total_training_steps=10 \
    trainer.save_freq=10 trainer.logger=[console] > "$out/smol_train.log" 2>&1 || echo "smol train: $(tail -2 "$out/smol_train.log")"
  mkdir -p "$out/smol_run" && cp "$work/smol_run/metrics.jsonl" "$out/smol_run/" 2>/dev/null
  stamp "SmolLM2-shaped 10 steps done"
  ckpt=$work/smol_run/checkpoints/$(cat "$work/smol_run/checkpoints/latest" 2>/dev/null)
  timeout "$(left)" python3 -m grpo_core.cli export "$ckpt" "$work/smol_export" > /dev/null 2>&1 || echo "export failed"
  stamp "SmolLM2-shaped export done"
fi

python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
limit = json.loads((out / "limit.json").read_text()) if (out / "limit.json").is_file() else {"steps": []}
print(f"\nceilings: {limit.get('tflops', 0):.0f} TFLOP/s bf16 matmul, {limit.get('tbps', 0):.2f} TB/s copy")
print("| implementation | step | step s | lower bound s | × bound | tokens/s/GPU |")
print("| --- | --- | --- | --- | --- | --- |")
for s in limit["steps"]:
    print(f"| project, {s['run']} | {s['step']} | {s['step_measured']:.2f} | {s['step_bound']:.2f} | "
          f"{s['step_measured'] / s['step_bound']:.2f}× | {s['tokens_per_s']:,.0f} |")
bounds = [s["step_bound"] for s in limit["steps"] if s["step"] > 1]
bound = sum(bounds) / len(bounds) if bounds else 0
if (out / "trl.json").is_file():
    trl = json.loads((out / "trl.json").read_text())
    for s in trl["steps"]:
        ratio = f"{s['seconds'] / bound:.2f}×" if bound else "–"
        print(f"| {trl['implementation']} | {s['step']} | {s['seconds']:.2f} | {bound:.2f} | {ratio} | "
              f"{s['tokens_per_s_per_gpu']:,.0f} |")
    print(f"TRL peak {trl['peak_gib']:.1f} GiB")
    ours = [s["step_measured"] for s in limit["steps"] if s["step"] > 1]
    theirs = [s["seconds"] for s in trl["steps"] if s["step"] > 1]
    if ours and theirs:  # the first steps compile and warm up on both sides
        print(f"project against TRL, mean step after the first: {sum(theirs) / len(theirs) / (sum(ours) / len(ours)):.2f}×")
smol = out / "smol_run" / "metrics.jsonl"
if smol.is_file():
    for r in map(json.loads, smol.read_text().splitlines()):
        if "timing/step" in r:
            print(f"smol step {r['step']}: {r['timing/step']:.2f} s (gen {r.get('timing/gen', 0):.2f}, "
                  f"update {r.get('timing/update', 0):.2f}), resp {r['response/length_mean']:.0f}")
PY
