"""GSM8K evaluation as `grpo evaluate --engine static --dtype bfloat16` does it, all questions in one engine batch.

    python3 bench/eval_static.py MODEL_DIR TEST_PARQUET OUT_DIR [--max-new-tokens 512] [--rows-per-batch 1319]

Greedy, one sample per question, all questions in one engine batch by default: on one H200 `generate` took about
100 s for SmolLM2-135M's 1,319 answers, the decode-step cost of this engine is a few ms. Writes samples.jsonl
and metrics.json (as `grpo evaluate`) under OUT_DIR and prints the metrics.
"""

import argparse
import json
import sys
import time

from grpo_core.evaluation.run import EvalSettings, evaluate_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rows-per-batch", type=int, default=1319)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--limit", type=int, help="only the first N questions")
    args = parser.parse_args()
    start = time.perf_counter()
    settings = EvalSettings(  # `grpo evaluate --engine static --dtype bfloat16`, every question in one batch
        max_new_tokens=args.max_new_tokens,
        batch_size=args.rows_per_batch,
        limit=args.limit,
        dtype="bfloat16",
        engine="static",
        max_prompt_length=args.max_model_len - args.max_new_tokens,
    )
    result = evaluate_model(args.model, args.data, args.out, settings)
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
