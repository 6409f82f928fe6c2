#!/usr/bin/env bash
# The CPU demo's learning settings (`make demo`, formerly `make demo-learn`), tried where a run takes a minute: configs/demo_cpu.yaml
# with 128-token responses (bf16, the static engine, the embedded GSM8K sample) but on a GPU, at several learning
# rates and prompts per step, each with two data seeds, all runs at once (a 135M model's step is host-bound: the
# GPU has room for all of them). Prints the training format rate and reward by step for each run: demo-learn's
# settings are the cheapest ones whose format rate rises within 10 steps.
#   bash bench/demo_sweep.sh MODEL_DIR OUT [STEPS]
# LRS, BATCHES (prompts per step) and SEEDS override the grid.
set -uo pipefail
model=$1 out=$2 steps=${3:-12} work=${WORK:-/tmp/demo-sweep}
mkdir -p "$out" "$work"
python3 -m grpo_core.cli prepare --source embedded --output "$work/gsm8k" > /dev/null || exit 1
for lr in ${LRS:-3e-5 1e-4 3e-4}; do
  for prompts in ${BATCHES:-2 4}; do
    for seed in ${SEEDS:-1 2}; do
      name="lr${lr}_p${prompts}_s${seed}"
      python3 -m grpo_core.cli train --config configs/demo_cpu.yaml actor_rollout_ref.model.path="$model" \
        trainer.device=cuda data.train_files="[$work/gsm8k/train.parquet]" data.val_files="[$work/gsm8k/test.parquet]" \
        actor_rollout_ref.actor.optim.lr="$lr" data.train_batch_size="$prompts" data.max_response_length=128 \
        actor_rollout_ref.rollout.max_num_seqs=32 \
        actor_rollout_ref.actor.ppo_mini_batch_size="$prompts" data.seed="$seed" \
        trainer.total_training_steps="$steps" trainer.default_local_dir="$work/$name" trainer.resume_mode=disable \
        > "$out/$name.log" 2>&1 &
    done
  done
done
wait
python3 - "$work" "$out" <<'PY'
import json, pathlib, sys

work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
print("| run | format rate by step | reward, first -> last | format, first 3 -> last 3 steps |")
print("| --- | --- | --- | --- |")
for run in sorted(work.glob("lr*")):
    rows = [json.loads(line) for line in open(run / "metrics.jsonl") if "reward/mean" in line]
    if not rows:
        print(f"| {run.name} | (no steps: see {run.name}.log) | | |")
        continue
    (out / f"{run.name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fmt = [r.get("reward/format_rate", 0.0) for r in rows]
    head, tail = sum(fmt[:3]) / len(fmt[:3]), sum(fmt[-3:]) / len(fmt[-3:])
    print(f"| {run.name} | {' '.join(f'{f:.2f}' for f in fmt)} | {rows[0]['reward/mean']:.3f} -> "
          f"{rows[-1]['reward/mean']:.3f} | {head:.2f} -> {tail:.2f} |")
PY
