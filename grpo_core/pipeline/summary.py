"""A pipeline run's results as numbers: accuracy before and after with the paired uplift (the same questions, so
McNemar's test and Newcombe's interval), what moved and by how much, throughput; and the headline metrics a
person compares runs by. Computed from the trainer's metrics.jsonl and the evaluations' per-sample records."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from grpo_core.config.schema import GRPOConfig
from grpo_core.evaluation.gsm8k import paired_outcomes, read_samples
from grpo_core.evaluation.stats import format_uplift, mean_difference, paired_uplift, verdict
from grpo_core.pipeline.run import pipeline_datasets
from grpo_core.tracking import METRICS_FILE


def training_rows(run_dir: str | Path) -> list[dict]:
    """The trainer's metrics.jsonl, one row per step: rows of the same step merge (a resumed run's validation at
    its first step beside the saved step's own metrics), later values winning."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


@dataclass
class PipelineSummary:
    accuracy_baseline: float
    accuracy: float
    accuracy_uplift: float
    throughput: float  # tokens/s per GPU, mean over the training steps
    step_seconds: float  # mean
    steps: int
    checkpoint: str
    uplift_ci95: tuple[float, float] = (-1.0, 1.0)  # paired: Newcombe's method 10 over the same questions
    uplift_p_value: float = 1.0  # exact McNemar
    questions: int = 0
    model_version: str | None = None
    champion: bool = False
    promotion: str = ""  # champion / challenger (empty: not registered)
    promotion_reason: str = ""
    mlflow_run_id: str = ""
    mlflow_url: str = ""
    moved: list[str] = field(default_factory=list)  # what_moved's lines
    format_rate: tuple[float, float] = (0.0, 0.0)  # the share of `#### N` answers, base and trained (evaluation)
    data_digests: dict[str, str] = field(default_factory=dict)  # context (training, evaluation) -> dataset digest
    model_version_url: str = ""
    compared_with: str = ""  # what the promotion compared the model with, and the result (notices.regression)
    compared_uplift: float | None = None
    compared_p_value: float | None = None


# The headline numbers, as metrics named to read in the runs table and MLflow's run comparison (no prefix).
HEADLINE_METRICS = (
    "accuracy_before",
    "accuracy_after",
    "uplift",
    "uplift_ci95_low",
    "uplift_ci95_high",
    "uplift_p_value",
    "format_rate_before",
    "format_rate_after",
    "tokens_per_s_per_gpu",
)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(
    cfg: GRPOConfig,
    rows: list[dict],
    base: dict,
    trained: dict,
    checkpoint: str,
    eval_dirs: dict[str, Path],
    mlflow_run_id: str,
) -> PipelineSummary:
    """The summary of a run (``rows``: ``training_rows``) whose base and trained models were evaluated as ``base``
    and ``trained`` (their metrics) into ``eval_dirs``; the registry's part is filled in when the model is
    registered (record.py)."""
    metric = cfg.evaluation.metric
    steps = max((r["step"] for r in rows), default=0)
    records = {name: read_samples(eval_dirs[name]) for name in ("base", "trained")}
    paired = paired_uplift(
        *paired_outcomes(records["base"], records["trained"], metric.replace("accuracy_", "correct_"))
    )
    summary = PipelineSummary(
        accuracy_baseline=base[metric],
        accuracy=trained[metric],
        accuracy_uplift=trained[metric] - base[metric],
        throughput=_mean([r["perf/throughput"] for r in rows if "perf/throughput" in r]),
        step_seconds=_mean([r["timing/step"] for r in rows if "timing/step" in r]),
        steps=steps,
        checkpoint=checkpoint,
        uplift_ci95=(paired["ci_low"], paired["ci_high"]),
        uplift_p_value=paired["p_value"],
        questions=paired["n"],
        mlflow_run_id=mlflow_run_id,
    )
    summary.moved = what_moved(cfg, rows, records, paired)
    summary.format_rate = format_rates(records)[:2]
    summary.data_digests = {k: d["digest"] for k, d in pipeline_datasets(cfg).items() if d is not None}
    return summary


def headline_metrics(summary: PipelineSummary) -> dict[str, float]:
    """``HEADLINE_METRICS`` of a summary: what a person compares runs by."""
    low, high = summary.uplift_ci95
    values = (
        summary.accuracy_baseline,
        summary.accuracy,
        summary.accuracy_uplift,
        low,
        high,
        summary.uplift_p_value,
        *summary.format_rate,
        summary.throughput,
    )
    return dict(zip(HEADLINE_METRICS, values, strict=True))


def what_moved(cfg: GRPOConfig, rows: list[dict], records: dict[str, list[dict]], accuracy: dict) -> list[str]:
    """The closing lines: the answer-format rate and the accuracy of the base and trained models on the same
    questions (paired), and the training reward of the first step against the last, each with its interval,
    sample count and whether it moved at all."""
    lines = []
    before, after, fmt = format_rates(records)
    lines.append(
        f"format rate (`#### N` answers, eval): {before:.3f} -> {after:.3f}, {format_uplift(fmt)}: {verdict(fmt)}"
    )
    steps = [r for r in rows if "reward/mean" in r and "reward/std" in r]
    if len(steps) >= 2:
        per_step = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
        first, last = ((r["reward/mean"], r["reward/std"], per_step) for r in (steps[0], steps[-1]))
        reward = mean_difference(first, last)
        lines.append(
            f"training reward (mean per sample): step {steps[0]['step']} {first[0]:.3f} -> step {steps[-1]['step']} "
            f"{last[0]:.3f}, {format_uplift(reward, unit='sample')} a step: {verdict(reward)}"
        )
    b, t = (accuracy["both"] + accuracy["only_base"]), (accuracy["both"] + accuracy["only_trained"])
    n = max(accuracy["n"], 1)
    lines.append(
        f"accuracy ({cfg.evaluation.metric}, eval): {b / n:.3f} -> {t / n:.3f}, {format_uplift(accuracy)}: "
        f"{verdict(accuracy)}"
    )
    return lines


def format_rates(records: dict[str, list[dict]]) -> tuple[float, float, dict]:
    """The share of answers in the expected format, base and trained, on the same questions, and their paired
    comparison."""
    fmt = paired_uplift(*paired_outcomes(records["base"], records["trained"], "format_ok"))
    n = max(fmt["n"], 1)
    return (fmt["both"] + fmt["only_base"]) / n, (fmt["both"] + fmt["only_trained"]) / n, fmt
