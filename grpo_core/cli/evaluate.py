"""``grpo evaluate``: GSM8K accuracy of a model (a hub id, a local or exported directory, or a registered
``models:/`` version), with pass@k and maj@k when it samples more than one answer per question."""

import argparse
import os
from pathlib import Path

from grpo_core.cli.common import UserError, console, err_console, missing_local_store
from grpo_core.config.defaults import schema_default
from grpo_core.tracking.registry import fetch_model, full_model, is_model_uri


def add_parser(sub: argparse._SubParsersAction) -> None:
    evaluate = sub.add_parser("evaluate", help="GSM8K accuracy of a model (hub id, local or `grpo export` directory)")
    evaluate.add_argument(
        "--model", required=True, help="hub id, local Hugging Face directory, or models:/NAME@ALIAS (or /VERSION)"
    )
    evaluate.add_argument("--data", required=True, help="verl-schema parquet, e.g. data/gsm8k/test.parquet")
    evaluate.add_argument(
        "--prompt-key", default=schema_default("data.prompt_key"), help="its column of chat messages (data.prompt_key)"
    )
    evaluate.add_argument("--output", default="eval_results", help="directory for samples.jsonl and metrics.json")
    evaluate.add_argument("--n", type=int, default=schema_default("evaluation.n"), help="samples per question")
    evaluate.add_argument(
        "--temperature", type=float, default=schema_default("evaluation.temperature"), help="0 is greedy"
    )
    evaluate.add_argument("--max-new-tokens", type=int, default=schema_default("evaluation.max_new_tokens"))
    evaluate.add_argument(
        "--batch-size",
        type=int,
        default=schema_default("evaluation.batch_size"),
        help="sequences generated at once (prompts x n)",
    )
    evaluate.add_argument("--limit", type=int, help="only the first N rows")
    evaluate.add_argument("--k", type=int, nargs="+", default=[1], help="k values for pass@k and maj@k (n > 1)")
    evaluate.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    evaluate.add_argument(
        "--engine",
        choices=["hf", "static"],
        default=schema_default("evaluation.engine"),
        help="static: dense Llama/Qwen2/Qwen3, several times faster",
    )
    evaluate.add_argument("--trust-remote-code", action="store_true")
    evaluate.add_argument(
        "--tracking-uri",
        help="MLflow server of a models:/ --model (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    evaluate.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args: argparse.Namespace) -> int:
    # lazy: torch, and `grpo --help` imports this module
    from grpo_core.evaluation.gsm8k import intervals
    from grpo_core.evaluation.run import EvalSettings, evaluate_model

    if min(args.n, args.max_new_tokens, args.batch_size, args.limit or 1) < 1 or args.temperature < 0:
        raise UserError("--n, --max-new-tokens, --batch-size and --limit must be >= 1, --temperature >= 0")
    if bad := [k for k in args.k if not 1 <= k <= args.n]:
        raise UserError(f"every --k must be between 1 and --n={args.n}; got {bad}")
    if args.n > 1 and args.temperature == 0:
        err_console.print("warning: --temperature 0 is greedy: all --n samples of a question are the same")
    settings = EvalSettings(
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        limit=args.limit,
        k_values=tuple(args.k),
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        engine=args.engine,
        prompt_key=args.prompt_key,
    )
    model = args.model
    if is_model_uri(model):
        server = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
        if problem := missing_local_store(server):
            raise UserError(problem)
        fetched = fetch_model(model, server)
        err_console.print(f"model: {fetched.describe()}", markup=False, highlight=False, soft_wrap=True)
        model = str(full_model(fetched, server))  # a LoRA adapter: merged into its base
    # a terminal shows the bar; piped or logged, a line per generate call (questions, tokens/s)
    lines = None if err_console.is_terminal else (lambda now: err_console.print(now.line("model"), markup=False))
    result = evaluate_model(model, args.data, args.output, settings, on_batch=lines)
    out = Path(args.output)
    cis = intervals(result.metrics)
    for name, value in result.metrics.items():
        ci = cis.get(f"{name}_ci95")
        within = f" [{ci[0]:.3f}, {ci[1]:.3f}] (95% Wilson)" if ci else ""
        console.print(f"{name}: {value:.4g}{within}", markup=False, highlight=False)
    rate = result.response_tokens / max(result.elapsed_s, 1e-9)
    console.print(
        f"{len(result.records)} samples, {result.response_tokens} tokens in {result.elapsed_s:.1f} s "
        f"({rate:.0f} tokens/s on {result.device})",
        markup=False,
    )
    console.print(f"records: {out / 'samples.jsonl'}", markup=False, soft_wrap=True)
    console.print(f"metrics: {out / 'metrics.json'}", markup=False, soft_wrap=True)
    return 0
