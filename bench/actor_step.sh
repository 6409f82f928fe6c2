#!/usr/bin/env bash
# The Megatron actor against a plain Hugging Face training step, per GPU, same config and batch, random weights.
# Usage (repo root, a machine with 2 GPUs): bash bench/actor_step.sh OUT_DIR [1gpu|2gpu|all]
# One GPU: Qwen2.5-1.5B at TP=1 (also with torch.compile off: the fused kernels' share; and 16 rows per
# micro-batch), HF; Qwen2.5-7B at TP=1 (fwd+bwd), HF. Two GPUs: 1.5B at TP=2 with sequence parallelism,
# 7B at TP=1 x DP=2 (the distributed optimizer's states fit over two GPUs) and at TP=2.
set -uo pipefail
out=${1:-bench-results} which=${2:-all}
mkdir -p "$out"
export CUDA_DEVICE_MAX_CONNECTIONS=1
m() { local n=$1; shift; torchrun --standalone --nproc-per-node "$n" bench/actor_step.py "$@" 2>&1 | tee -a "$out/all.log" | tail -1; }
hf() { python3 bench/actor_step.py --impl hf "$@" 2>&1 | tee -a "$out/all.log" | tail -1; }
if [ "$which" != 2gpu ]; then
  m 1 --model Qwen/Qwen2.5-1.5B --tp 1 --batch 8 --micro-batch 8 --profile --out "$out/1.5b_tp1.json"
  TORCH_COMPILE_DISABLE=1 m 1 --model Qwen/Qwen2.5-1.5B --tp 1 --batch 8 --micro-batch 8 --skip-update \
      --label "no compile" --out "$out/1.5b_tp1_eager.json"
  hf --model Qwen/Qwen2.5-1.5B --batch 8 --profile --out "$out/1.5b_hf.json"
  # micro-batch sizing: twice the rows per micro-batch, both sides
  m 1 --model Qwen/Qwen2.5-1.5B --tp 1 --batch 16 --micro-batch 16 --profile --label "16 rows" \
      --out "$out/1.5b_tp1_b16.json"
  hf --model Qwen/Qwen2.5-1.5B --batch 16 --micro-batch 16 --label "16 rows" --out "$out/1.5b_hf_b16.json"
  # 7B on one GPU: fwd+bwd only (Adam's states for 7B do not fit next to the rest)
  m 1 --model Qwen/Qwen2.5-7B --tp 1 --batch 4 --micro-batch 4 --skip-update --profile --out "$out/7b_tp1.json"
  hf --model Qwen/Qwen2.5-7B --batch 4 --profile --out "$out/7b_hf.json"
fi
if [ "$which" != 1gpu ]; then
  m 2 --model Qwen/Qwen2.5-1.5B --tp 2 --batch 8 --micro-batch 8 --out "$out/1.5b_tp2.json"
  m 2 --model Qwen/Qwen2.5-7B --tp 1 --batch 4 --micro-batch 4 --out "$out/7b_tp1_dp2.json"
  m 2 --model Qwen/Qwen2.5-7B --tp 2 --batch 8 --micro-batch 4 --profile --out "$out/7b_tp2.json"
fi
python3 - "$out" <<'PY'
import json, pathlib, sys
print("\n| impl | model | GPUs (TP) | rows x seq | fwd+bwd tok/s/GPU | update tok/s/GPU | log-prob tok/s/GPU "
      "| fwd+bwd TFLOP/s/GPU | peak GiB | fwd+bwd kernel ms: gemm / attn / nccl / other / wall |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    cell = lambda k: f"{r[k]:,.0f}" if k in r else "-"
    b = r.get("fwd_bwd_kernel_ms")
    kern = " / ".join(f"{b[k]:.0f}" for k in ("gemm", "attention", "nccl", "other", "wall")) if b else "-"
    print(f"| {r['impl']} {r['label']} | {r['model']} | {r['gpus']} (TP={r['tp']}) | {r['rows']} x {r['seq']} "
          f"| {cell('fwd_bwd_tokens_per_s_per_gpu')} | {cell('update_tokens_per_s_per_gpu')} "
          f"| {cell('log_prob_tokens_per_s_per_gpu')} | {r['fwd_bwd_tflops_per_gpu']:.0f} | {r['peak_mem_gib']:.1f} | {kern} |")
PY
