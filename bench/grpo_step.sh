#!/usr/bin/env bash
# Whole GRPO steps with their phase breakdown (`grpo train`, static engine, random weights, GSM8K prompts).
#   bash bench/grpo_step.sh TOKENIZER_DIR DATA_DIR OUT [7b]
# TOKENIZER_DIR: any tokenizer whose ids fit the model (SmolLM2's; random weights never stop early, so
# every response runs to 256 tokens). DATA_DIR: `grpo prepare` output. Runs Qwen2.5-1.5B at TP=1 on one
# GPU (micro-batches of 16 rows, then of 8,192 tokens, then larger budgets; RUNS="rows budget large kept" picks) and,
# with "7b", Qwen2.5-7B at
# TP=2 on two. Metrics under OUT/<run>/metrics.jsonl; a table last.
# EXTRA: overrides added to every run (trainer.profile_steps=[N] adds a table of where step N's GPU time
# went, and OUT/<run>/kernels_step_00000N.md: each phase's heaviest kernels with their launchers and its longest
# idle gaps, from bench/trace_kernels.py).
# Models and checkpoints (tens of GB) go to WORK (default /tmp/bench-work).
set -uo pipefail
tok=$1 data=$2 out=$3 big=${4:-} work=${WORK:-/tmp/bench-work}
mkdir -p "$out" "$work"
run() {  # name, model, overrides...
  name=$1 model=$2; shift 2
  [ -d "$work/$model" ] || python3 bench/random_hf_model.py --model "Qwen/$model" --tokenizer "$tok" "$work/$model"
  python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_gpu.yaml actor_rollout_ref.model.path="$work/$model" \
    data.train_files="[$data/train.parquet]" data.val_files="[$data/test.parquet]" data.train_batch_size=64 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.rollout.name=static actor_rollout_ref.rollout.max_num_seqs=512 \
    trainer.default_local_dir="$work/$name" trainer.resume_mode=disable trainer.total_training_steps=3 \
    trainer.save_freq=-1 trainer.logger=[console] "$@" ${EXTRA:-} > "$out/$name.log" 2>&1 || echo "$name failed: $(tail -3 "$out/$name.log")"
  mkdir -p "$out/$name" && cp "$work/$name/metrics.jsonl" "$out/$name/" 2>/dev/null
  for trace in "$work/$name"/profile/*.json.gz; do
    [ -f "$trace" ] && python3 bench/trace_kernels.py "$trace" > "$out/$name/kernels_$(basename "$trace" .json.gz).md"
  done
}
runs=${RUNS:-rows budget}
[[ $runs == *rows* ]] && run qwen1.5b_tp1 Qwen2.5-1.5B
# micro-batches by a token budget (16 full-length rows' worth) instead of 16 rows; both packed
[[ $runs == *budget* ]] && run qwen1.5b_tp1_budget Qwen2.5-1.5B actor_rollout_ref.actor.use_dynamic_bsz=true \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192
# larger budgets: 16,384 tokens per update micro-batch, 32,768 per log-prob forward (the fastest measured, sized for
# 141 GB: on a smaller card the run stops before launch and names the budgets that fit, to pass in EXTRA);
# RUNS=kept: the same with the engine's cache and graphs kept between rollouts (free_cache_engine=false)
large=(actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768)
[[ $runs == *large* ]] && run qwen1.5b_tp1_large Qwen2.5-1.5B "${large[@]}"
[[ $runs == *kept* ]] && run qwen1.5b_tp1_kept Qwen2.5-1.5B "${large[@]}" actor_rollout_ref.rollout.free_cache_engine=false
if [ "$big" = 7b ]; then
  run qwen7b_tp2 Qwen2.5-7B trainer.n_gpus_per_node=2 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.max_num_seqs=256
fi
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
phases = ("gen", "old_log_prob", "ref", "update", "sync", "step")
print("| run | step | " + " | ".join(f"{p} s" for p in phases) + " | gc s | compiles (s) | cudaMalloc (retries) | tokens/s/GPU | resp len | logprob diff max | peak GiB |")
print("|" + " --- |" * (len(phases) + 9))
for path in sorted(out.glob("*/metrics.jsonl")):
    for r in (json.loads(line) for line in path.read_text().splitlines()):
        if "timing/gen" in r:
            print(f"| {path.parent.name} | {r['step']} | " + " | ".join(f"{r.get('timing/' + p, 0):.2f}" for p in phases)
                  + f" | {r.get('perf/gc_s', 0):.2f} | {r.get('perf/compiles', 0):.0f} ({r.get('perf/compile_s', 0):.1f})"
                  f" | {r.get('perf/cuda_mallocs', 0):.0f} ({r.get('perf/alloc_retries', 0):.0f})"
                  f" | {r['perf/throughput']:,.0f} | {r['response/length_mean']:.0f} | "
                  f"{r['rollout/log_prob_diff_max']:.2e} | {r.get('perf/max_memory_gib', 0):.1f} |")
# the static engine's parts of the gen phase; "rest": gathering, decoding the texts and scoring them
parts = ("capture", "prefill", "decode", "collect")
print("\n| run | step | gen s | " + " | ".join(f"{p} s" for p in parts) + " | rest s | decode ms/step |")
print("|" + " --- |" * (len(parts) + 5))
for path in sorted(out.glob("*/metrics.jsonl")):
    for r in (json.loads(line) for line in path.read_text().splitlines()):
        if "rollout/decode_s" in r:
            seconds = [r.get(f"rollout/{p}_s", 0) for p in parts]
            per_step = 1e3 * r["rollout/decode_s"] / max(r.get("rollout/decode_steps", 1), 1)
            print(f"| {path.parent.name} | {r['step']} | {r['timing/gen']:.2f} | " + " | ".join(f"{x:.2f}" for x in seconds)
                  + f" | {r['timing/gen'] - sum(seconds):.2f} | {per_step:.2f} |")
# a step profiled (EXTRA=trainer.profile_steps=[N]): each phase's idle share, and its kernel time by kind
kinds = ("gemm", "attention", "comm", "copy", "other")
profiled = [(path.parent.name, r) for path in sorted(out.glob("*/metrics.jsonl"))
            for r in map(json.loads, path.read_text().splitlines()) if any(k.startswith("profile/idle") for k in r)]
if profiled:
    print("\n| run | step | phase | idle % | host syncs | " + " | ".join(f"{k} % of kernel time" for k in kinds) + " |")
    print("|" + " --- |" * (len(kinds) + 5))
for name, r in profiled:
    for p in phases:
        if f"profile/idle_share_{p}" in r:
            print(f"| {name} | {r['step']} | {p} | {100 * r[f'profile/idle_share_{p}']:.0f} | "
                  f"{r.get(f'profile/host_syncs_{p}', 0):.0f} | "
                  + " | ".join(f"{100 * r.get(f'profile/{k}_time_share_{p}', 0):.0f}" for k in kinds) + " |")
PY
