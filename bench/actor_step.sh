#!/usr/bin/env bash
# The Megatron actor's update throughput on one and two GPUs, next to ../shared/notes/gpu-baseline.md.
# Usage (from the repo root, on a machine with 2 GPUs): bash bench/actor_step.sh OUT_DIR
set -euo pipefail
out=${1:-bench-results}
mkdir -p "$out"
run() { torchrun --standalone --nproc-per-node "$@"; }
run 1 bench/actor_step.py --model Qwen/Qwen2.5-1.5B --tp 1 --batch 8 --micro-batch 8 --out "$out/qwen1.5b_tp1.json"
run 2 bench/actor_step.py --model Qwen/Qwen2.5-1.5B --tp 2 --batch 8 --micro-batch 8 --out "$out/qwen1.5b_tp2_sp.json"
run 2 bench/actor_step.py --model Qwen/Qwen2.5-1.5B --tp 2 --batch 8 --micro-batch 8 --no-sequence-parallel \
    --out "$out/qwen1.5b_tp2.json"
run 2 bench/actor_step.py --model Qwen/Qwen2.5-7B --tp 2 --batch 4 --micro-batch 4 --out "$out/qwen7b_tp2_sp.json"
python3 - "$out" <<'PY'
import json, pathlib, sys
print("| model | GPUs (TP) | SP | batch x seq | update tokens/s/GPU | update TFLOP/s/GPU | log-prob tokens/s/GPU | peak GiB |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    print(f"| {r['model']} | {r['gpus']} (TP={r['tp']}) | {r['sequence_parallel']} | {r['batch_per_dp'] * r['dp']} x {r['seq']} "
          f"| {r['update_tokens_per_s_per_gpu']:,.0f} | {r['update_tflops_per_gpu']:.0f} "
          f"| {r['log_prob_tokens_per_s_per_gpu']:,.0f} | {r['peak_mem_gib']:.1f} |")
PY
