#!/usr/bin/env bash
# Rollout throughput (static engine vs transformers.generate, Qwen2.5-1.5B), then Qwen2.5-7B start-up to
# the first rollout and weight-sync seconds, loading a random 7B checkpoint from disk, at TP=1 and TP=2.
#   bash bench/rollout.sh OUT [tp2]      (the 15 GB checkpoint goes to WORK, default /tmp/bench-work)
set -uo pipefail
out=$1 two=${2:-} work=${WORK:-/tmp/bench-work}
mkdir -p "$out" "$work"
python3 bench/rollout_throughput.py --model Qwen/Qwen2.5-1.5B --out "$out/rollout_1.5b.json" 2>&1 | tee "$out/rollout.log" | tail -11
[ -d "$work/Qwen2.5-7B" ] || python3 bench/random_hf_model.py --model Qwen/Qwen2.5-7B --tokenizer "${TOKENIZER:-.gpu3/smol}" "$work/Qwen2.5-7B"
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "(page cache not dropped: the 7B checkpoint may load from memory)"
startup() {  # nproc, tp
  BENCH_START=$(date +%s.%N) torchrun --standalone --nproc-per-node "$1" bench/sync_startup.py --model Qwen/Qwen2.5-7B \
    --hf-dir "$work/Qwen2.5-7B" --tp "$2" --out "$out/sync_7b_tp$2.json" 2>&1 | tee "$out/sync_tp$2.log" | tail -11
}
startup 1 1
[ "$two" = tp2 ] && startup 2 2
