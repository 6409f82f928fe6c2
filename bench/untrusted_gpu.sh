#!/usr/bin/env bash
# Issue 42's guards on the GPU machine (megatron-core 0.19, NCCL), which CI (0.16, gloo) cannot show: a random
# SmolLM2-shaped model trains 2 steps through `grpo train` (full checkpoint contents, then each rank's optimizer
# shards), is verified (the weights-only check of every pickled item: 0.19 keeps megatron's common state as one),
# exported and resumed for a third step, all with every torch.load weights-only; every listening socket of the
# run is sampled (from /proc/net/tcp*, which needs no ss), and any beyond loopback is listed.
#   bash bench/gpu_call.sh bench/untrusted_gpu.sh     (after bench/gpu_carry.sh here)
set -uo pipefail
tok=$1 gsm8k=$2 out=$3 work=${WORK:-/tmp/untrusted}
mkdir -p "$out" "$work"
python3 bench/random_hf_model.py --model HuggingFaceTB/SmolLM2-135M --tokenizer "$tok" "$work/model" > /dev/null 2>&1
python3 -m grpo_core.cli prepare --source "$gsm8k" --output "$work/data" > "$out/prepare.log" 2>&1
sockets() {  # the listening TCP sockets' local addresses, one a line, from the kernel's tables (no ss needed)
  python3 - <<'PY'
import socket
for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            address, port = local.split(":")
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            ip = socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
            print(f"{ip}:{int(port, 16)}" if family == socket.AF_INET else f"[{ip}]:{int(port, 16)}")
PY
}
listening() {  # every listening socket, every 0.5 s, until $work/stop appears (a killed loop kept the call's output open)
  while [ ! -e "$work/stop" ]; do sockets; sleep 0.5; done 2>/dev/null | sort -u > "$1"
}
train() {  # NAME STEPS EXTRA...
  local name=$1 steps=$2; shift 2
  python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_gpu.yaml actor_rollout_ref.model.path="$work/model" \
    data.train_files="[$work/data/train.parquet]" data.val_files="[$work/data/test.parquet]" \
    data.train_batch_size=16 actor_rollout_ref.actor.ppo_mini_batch_size=16 data.max_response_length=128 \
    actor_rollout_ref.rollout.name=static trainer.total_training_steps="$steps" trainer.save_freq=1 \
    trainer.default_local_dir="$work/$name" "$@" > "$out/$name.$steps.log" 2>&1
  echo "$?"
}
row() { printf '| %-44s | %s |\n' "$1" "$2"; }
sockets | sort -u > "$out/listening.before.txt"  # the machine's own listeners
rm -f "$work/stop"
listening "$out/listening.txt" &
sampler=$!
full=$(train full 2 "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
touch "$work/stop"
wait $sampler
ckpt=$work/full/checkpoints/step_000002
python3 -m grpo_core.cli verify "$ckpt" > "$out/verify.log" 2>&1; verify=$?
python3 - "$ckpt" > "$out/items.log" 2>&1 <<'EOF'
import sys
from pathlib import Path
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from grpo_core.checkpoint.contents import read_metadata
m = read_metadata(Path(sys.argv[1]))
items = [k for k, v in m.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
print(f"{len(items)} pickled items: {', '.join(sorted({i.split('/')[0] for i in items}))}")
EOF
python3 -m grpo_core.cli export "$ckpt" "$work/exported" > "$out/export.log" 2>&1; export=$?
resumed=$(train full 3)
per_rank=$(train per_rank 2 actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=false)
per_rank_resumed=$(train per_rank 3 actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=false)
# the run's listeners (not there before it) beyond loopback
wild=$(comm -13 "$out/listening.before.txt" "$out/listening.txt" | grep -v -E '^127\.|^\[::1\]:|^\[::ffff:127\.' || true)
{
  echo "| step | result |"
  echo "|---|---|"
  row "train 2 steps, full contents (exit)" "$full"
  row "grpo verify step_000002 (exit)" "$verify: $(tail -n1 "$out/verify.log" | cut -c1-160)"
  row "what the checkpoint pickles" "$(tail -n1 "$out/items.log")"
  row "grpo export (exit)" "$export"
  row "resume to step 3 (exit)" "$resumed: $(grep -c 'resumed from' "$out/full.3.log") 'resumed from' line(s)"
  row "per-rank optimizer shards: train, resume (exit)" "$per_rank, $per_rank_resumed: $(grep -c 'resumed from' "$out/per_rank.3.log") 'resumed from'"
  row "run's listeners beyond loopback" "${wild:-none} ($(comm -13 "$out/listening.before.txt" "$out/listening.txt" | wc -l) sampled)"
} | tee "$out/table.md"
