"""GSM8K evaluation (`grpo evaluate`'s grading and files) with the static CUDA-graph engine in place of HF generate.

    python3 bench/eval_static.py MODEL_DIR TEST_PARQUET OUT_DIR [--max-new-tokens 512] [--rows-per-batch 1319]

Greedy, one sample per question, all questions in one engine batch by default: on one H200 `generate` took about
100 s for SmolLM2-135M's 1,319 answers, the decode-step cost of this engine is a few ms. Writes samples.jsonl
and metrics.json (as `grpo evaluate`) under OUT_DIR and prints the metrics.
"""

import argparse
import json
import sys
import time

import torch

from grpo_core.data.prompts import load_rows
from grpo_core.evaluation.gsm8k import evaluate, write_results
from grpo_core.models.shape import load_model_shape
from grpo_core.rollout.hf import load_generation_config, load_tokenizer, stop_ids
from grpo_core.rollout.static import StaticEngine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rows-per-batch", type=int, default=1319)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--limit", type=int, help="only the first N questions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    engine = StaticEngine(
        load_model_shape(args.model),
        stop_ids(tokenizer, load_generation_config(args.model)),
        dtype="bfloat16",
        device=args.device,
        max_batch_size=args.rows_per_batch,
        max_model_len=args.max_model_len,
    ).load(args.model)
    rows = load_rows(args.data, args.limit)
    result = evaluate(
        engine,
        tokenizer,
        rows,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.rows_per_batch,
        progress=False,
    )
    result.device = args.device
    write_results(result, args.out)
    summary = {
        **result.metrics,
        "generate_s": result.elapsed_s,
        "tokens_per_s": result.response_tokens / result.elapsed_s,
        "total_s": time.perf_counter() - start,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
