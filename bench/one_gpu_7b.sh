#!/usr/bin/env bash
# A Qwen2.5-7B-shaped GRPO step on ONE GPU through `grpo train` (random weights, SmolLM2's tokenizer, the same
# 64 prompts x 8 samples x 256 tokens as bench/grpo_step.sh): megatron's hybrid CPU optimizer steps FRACTION
# (default 0.5) of Adam on the host, asked for through override_optimizer_config with
# megatron.optimizer_offload off, so the optimizer's GPU side (fp32 masters, the rest of Adam) stays on the GPU
# and the host holds only the CPU optimizer's 16 B per parameter (8 pinned per tensor, rounded up to powers of
# two); the reference model in host memory between
# uses; TOKENS-token micro-batches (default 2048). GPU and host memory are sampled every 5 s. Then how fast a
# 15 GB checkpoint's bytes can be hashed (what manifest verification costs).
#   bash bench/one_gpu_7b.sh TOKENIZER_DIR DATA_DIR OUT   (HASH=0 skips the hashing)
# The run ends with its checkpoint save, written by the streaming writer: with each rank's optimizer shards
# (dist_ckpt_optim_fully_reshardable=false) the host holds the CPU optimizer's 82 GiB, the reference's 14 GiB and
# two tensors in flight (the dry run: 100 GiB of the node's 125). CONTENTS (default [model,extra]) is
# actor.checkpoint.save_contents: the H200 machine's 64 GiB disk holds the random model (15 GB) and a
# model-only checkpoint (15 GB), not one with Adam's state (~106 GB). HOST_GIB overrides the node's host memory
# for the dry run.
set -uo pipefail
tok=$1 data=$2 out=$3 work=${WORK:-/tmp/bench-work} model=${WORK:-/tmp/bench-work}/Qwen2.5-7B
mkdir -p "$out"
[ -d "$model" ] || python3 bench/random_hf_model.py --model Qwen/Qwen2.5-7B --tokenizer "$tok" "$model" > /dev/null 2>&1
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 5 > "$out/gpu_mib.txt" &
# host memory by kind: on the H200 machine the run's pinned buffers (CPU optimizer, reference) showed as page cache
# in vmstat (82 GB of it went at the process's exit), so free memory alone misreads them
while sleep 5; do awk '/^(MemAvailable|Shmem|AnonPages):/ {printf "%s %d ", $1, $2 / 1024} END {print ""}' /proc/meminfo; done > "$out/meminfo.txt" &
timeout "${TRAIN_S:-420}" python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_gpu.yaml \
  actor_rollout_ref.model.path="$model" data.train_files="[$data/train.parquet]" data.val_files="[$data/test.parquet]" \
  data.train_batch_size=64 actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.use_dynamic_bsz=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu="${TOKENS:-2048}" \
  actor_rollout_ref.rollout.name=static actor_rollout_ref.rollout.max_num_seqs=512 \
  actor_rollout_ref.ref.megatron.param_offload=true \
  +actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=true \
  +actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction="${FRACTION:-0.5}" \
  +actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=true \
  trainer.default_local_dir="$work/qwen7b_1gpu" trainer.resume_mode=disable trainer.total_training_steps=3 \
  actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=false \
  actor_rollout_ref.actor.checkpoint.save_contents="${CONTENTS:-[model,extra]}" \
  trainer.save_freq=-1 trainer.logger=[console] ${HOST_GIB:+trainer.host_memory_gib=$HOST_GIB} ${EXTRA:-} > "$out/qwen7b_1gpu.log" 2>&1
echo "train exit $?"
kill %1 %2 2>/dev/null
sync; echo 3 2>/dev/null > /proc/sys/vm/drop_caches && echo "page cache dropped: the first hash reads from disk"
mkdir -p "$out/qwen7b_1gpu" && cp "$work/qwen7b_1gpu/metrics.jsonl" "$out/qwen7b_1gpu/" 2>/dev/null
python3 - "$out" "$model" <<'PY'
import hashlib, json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

out, model = Path(sys.argv[1]), Path(sys.argv[2])
for r in map(json.loads, (out / "qwen7b_1gpu/metrics.jsonl").read_text().splitlines() if (out / "qwen7b_1gpu/metrics.jsonl").is_file() else []):
    if "timing/step" in r:
        print(f"7b step {r['step']}: {r['timing/step']:.1f} s (gen {r.get('timing/gen', 0):.1f}, old {r.get('timing/old_log_prob', 0):.1f}, "
              f"ref {r.get('timing/ref', 0):.1f}, update {r.get('timing/update', 0):.1f}), {r['perf/throughput']:,.0f} tok/s/GPU, "
              f"peak {r.get('perf/max_memory_gib', 0):.1f} GiB")
gpu = [int(x) for x in (out / "gpu_mib.txt").read_text().split() if x.isdigit()]
host = [dict(zip(line.split()[::2], map(int, line.split()[1::2]))) for line in (out / "meminfo.txt").read_text().splitlines()]
peak = lambda key, pick=max: pick((h.get(key, 0) for h in host), default=0) / 1024  # noqa: E731
print(f"sampled peaks: GPU {max(gpu, default=0) / 1024:.1f} GiB used; host available min {peak('MemAvailable:', min):.1f} GiB, "
      f"pinned/shared max {peak('Shmem:'):.1f} GiB, anonymous max {peak('AnonPages:'):.1f} GiB")
files = sorted(model.glob("*.safetensors")) if os.environ.get("HASH", "1") == "1" else []
size = sum(f.stat().st_size for f in files)
for name in ("xxh3_128", "sha256", "blake2b"):
    try:
        if name == "xxh3_128":
            import xxhash
            new = xxhash.xxh3_128
        else:
            new = getattr(hashlib, name)
    except ImportError:
        continue
    def digest(f, new=new):
        h = new()
        with f.open("rb") as fh:
            while chunk := fh.read(16 << 20):
                h.update(chunk)
        return h.hexdigest()
    t = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(digest, files))
    s = time.perf_counter() - t
    print(f"hash {name}: {size / 1e9:.1f} GB in {len(files)} files, {s:.1f} s, {size / 1e9 / s:.2f} GB/s (8 threads)")
PY
