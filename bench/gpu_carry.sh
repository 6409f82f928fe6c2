#!/usr/bin/env bash
# Gathers, on this machine, what a benchmark call on the lent GPU machine needs and lacks (it has torch and
# transformers but no network) into .carry/, to pass as the device tool's `carry`: Python 3.12 wheels of
# megatron-core and omegaconf for the project, of TRL, peft and its datasets stack for the peer (../shared/notes/peers.md),
# SmolLM2's tokenizer and the GSM8K release. On the GPU machine, bench/gpu_call.sh installs and uses them.
#   bash bench/gpu_carry.sh [SHARED_DIR]   (default ../shared)
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${1:-../shared} carry=.carry
pip=$([ -x .venv/bin/pip ] && echo .venv/bin/pip || echo "python3 -m pip")
mkdir -p "$carry/wheels"
$pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform any -d "$carry/wheels" megatron-core==0.19.2 omegaconf==2.4.0 \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 peft==0.21.2
rm -rf "$carry/tok" "$carry/gsm8k_src"
cp -r "$shared/models/smollm2-135m-instruct/tokenizer" "$carry/tok"
cp -r "$shared/data/gsm8k" "$carry/gsm8k_src"
chmod -R u+w "$carry"
du -sh "$carry"
