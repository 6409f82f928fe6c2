"""Evaluation: per-sample records and accuracies, computed without any server."""

from grpo_core.data.prompts import load_rows
from grpo_core.evaluation.gsm8k import (
    EvalResult,
    accuracy_uplift,
    evaluate,
    majority_vote,
    pass_at_k,
    summarize,
    write_results,
)

__all__ = [
    "EvalResult",
    "accuracy_uplift",
    "evaluate",
    "load_rows",
    "majority_vote",
    "pass_at_k",
    "summarize",
    "write_results",
]
