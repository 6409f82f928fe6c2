"""The MLflow side of one pipeline: a run keyed by what it trains, its params, results, plots and model.

One MLflow run per pipeline key (the resolved config and the training data): a re-run after a crash
finds and continues the same run instead of starting a second one. The trainer logs its per-step
metrics into it (``GRPO_MLFLOW_RUN_ID``); the pipeline adds the evaluations, the uplift, the plots and the
registered model. Plain functions: the Prefect flow calls them, tests call them without Prefect.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpo_core.config.load import to_flat_dict, to_yaml
from grpo_core.config.schema import GRPOConfig
from grpo_core.evaluation.gsm8k import paired_outcomes, read_samples
from grpo_core.evaluation.stats import format_uplift, mean_difference, paired_uplift, verdict
from grpo_core.tracking import METRICS_FILE
from grpo_core.tracking.mlflow_run import MlflowRun, quick_http, tracking_uri
from grpo_core.tracking.plots import Curves, eval_points, plot_curves, plot_run

KEY_TAG = "grpo.pipeline_key"
NOT_IN_KEY = (
    "tracking.",
    "evaluation.",
    "launch.",
    "trainer.logger",
    "trainer.project_name",
    "trainer.experiment_name",
)


def file_digest(path: str | Path) -> str:
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pipeline_key(cfg: GRPOConfig) -> str:
    """What the trained model depends on: the resolved config (less where results are logged, how ranks are
    started and how the model is evaluated afterwards), the training data's bytes and a custom reward file's."""
    settings = {k: v for k, v in to_flat_dict(cfg).items() if not k.startswith(NOT_IN_KEY)}
    parts = [json.dumps(settings, sort_keys=True, default=str)]
    inputs = [*cfg.data.train_files, *filter(None, [cfg.custom_reward_function.path])]
    parts += [file_digest(p) for p in inputs if Path(p).is_file()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def open_pipeline_run(cfg: GRPOConfig, key: str, tags: dict[str, str], local_dir: Path) -> MlflowRun:
    """The pipeline's MLflow run: the unfinished or finished one with this key, else a new one."""
    from mlflow import MlflowClient

    quick_http()  # a server that is down fails the pipeline in seconds, not after minutes of retries
    t, uri = cfg.trainer, tracking_uri(cfg)
    pending = local_dir / "mlflow_pending.jsonl"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(t.project_name)
    if experiment is not None:
        found = client.search_runs([experiment.experiment_id], f"tags.`{KEY_TAG}` = '{key}'", max_results=1)
        if found:
            run = MlflowRun(uri, found[0].info.run_id, pending_file=pending)
            run.set_tags(tags)
            run.client.update_run(run.run_id, status="RUNNING")
            return run
    run = MlflowRun.create(uri, t.project_name, t.experiment_name, {KEY_TAG: key, **tags}, pending_file=pending)
    run.log_params(to_flat_dict(cfg))
    local_dir.mkdir(parents=True, exist_ok=True)
    resolved = local_dir / "resolved_config.yaml"
    resolved.write_text(to_yaml(cfg))
    run.log_artifact(resolved)
    return run


def run_url(run: MlflowRun) -> str:
    """A link to the run in the MLflow UI (for a local store: the UI to start, then the link)."""
    info = run.client.get_run(run.run_id).info
    path = f"#/experiments/{info.experiment_id}/runs/{run.run_id}"
    uri = run.tracking_uri
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{path}"
    return f"`mlflow ui --backend-store-uri {uri}` then http://127.0.0.1:5000/{path}"


def training_rows(run_dir: str | Path) -> list[dict]:
    """The trainer's metrics.jsonl, one row per step (a step logged twice across a resume: the last one)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
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
    mlflow_run_id: str = ""
    mlflow_url: str = ""
    moved: list[str] = field(default_factory=list)  # what_moved's lines


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def record_results(
    run: MlflowRun,
    cfg: GRPOConfig,
    base: dict,
    trained: dict,
    checkpoint: str,
    eval_dirs: dict[str, Path],
    model_dir: Path | None,
) -> PipelineSummary:
    """Log the evaluations, uplift, summaries, plots, eval samples and the model; register it (champion on uplift)."""
    metric = cfg.evaluation.metric
    rows = training_rows(cfg.trainer.default_local_dir)
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
        mlflow_run_id=run.run_id,
    )
    summary.moved = what_moved(cfg, rows, records, paired)
    run.log_metrics(
        {
            "val/accuracy_baseline": summary.accuracy_baseline,
            "val/accuracy": summary.accuracy,
            "val/accuracy_uplift": summary.accuracy_uplift,
            "val/accuracy_uplift_ci95_low": paired["ci_low"],
            "val/accuracy_uplift_ci95_high": paired["ci_high"],
            "val/accuracy_uplift_p_value": paired["p_value"],
            "perf/throughput_mean": summary.throughput,
            "timing/step_mean": summary.step_seconds,
            **{f"eval/base/{k}": v for k, v in base.items()},
            **{f"eval/trained/{k}": v for k, v in trained.items()},
        },
        step=steps,
    )
    plots_dir = Path(cfg.trainer.default_local_dir) / "plots"
    plots = plot_run(rows, plots_dir, summary.accuracy_baseline, summary.accuracy)
    reward = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    accuracy = eval_points(summary.accuracy_baseline, summary.accuracy, summary.questions, max(steps, 1))
    plots.append(plot_curves([Curves(cfg.trainer.experiment_name, reward, accuracy)], plots_dir / "curves.png"))
    for path in plots:
        run.log_artifact(path, "plots")
    for name, directory in eval_dirs.items():
        run.log_artifact(directory, f"eval/{name}")
    if model_dir is not None and cfg.tracking.log_model:
        summary.model_version, summary.champion = register_model(run, cfg, model_dir, summary.accuracy_uplift)
    summary.mlflow_url = run_url(run)
    run.set_tags({"grpo.steps": str(steps), "grpo.champion": str(summary.champion).lower()})
    return summary


def register_model(run: MlflowRun, cfg: GRPOConfig, model_dir: Path, uplift: float) -> tuple[str, bool]:
    """The exported model as a run artifact and a new registry version; alias ``champion`` above the threshold."""
    from mlflow.exceptions import MlflowException

    run.log_artifact(model_dir, "model")
    if not run.flush():
        raise ConnectionError(f"MLflow at {run.tracking_uri} is unreachable; cannot register the model now")
    name = cfg.tracking.registered_model_name or cfg.trainer.project_name
    client = run.client
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{client.get_run(run.run_id).info.artifact_uri}/model"
    version = client.create_model_version(name, source, run_id=run.run_id, tags={"accuracy_uplift": f"{uplift:.6f}"})
    champion = uplift > cfg.tracking.champion_min_uplift
    if champion:
        client.set_registered_model_alias(name, "champion", version.version)
    return version.version, champion


def what_moved(cfg: GRPOConfig, rows: list[dict], records: dict[str, list[dict]], accuracy: dict) -> list[str]:
    """The closing lines: the answer-format rate and the accuracy of the base and trained models on the same
    questions (paired), and the training reward of the first step against the last, each with its interval,
    sample count and whether it moved at all."""
    lines = []
    fmt = paired_uplift(*paired_outcomes(records["base"], records["trained"], "format_ok"))
    before, after = (
        (fmt["both"] + fmt["only_base"]) / max(fmt["n"], 1),
        (fmt["both"] + fmt["only_trained"]) / max(fmt["n"], 1),
    )
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


def uplift_line(summary: PipelineSummary | dict) -> str:
    """The summary's uplift as ``format_uplift`` writes it (the summary, or the flow's dict of it)."""
    s = summary if isinstance(summary, dict) else asdict(summary)
    low, high = s["uplift_ci95"]
    result = {"uplift": s["accuracy_uplift"], "ci_low": low, "ci_high": high, "p_value": s["uplift_p_value"]}
    return format_uplift({**result, "n": s["questions"]})


def markdown_report(summary: PipelineSummary, cfg: GRPOConfig) -> str:
    """The table a person reads first (the Prefect artifact, the CLI's closing lines)."""
    metric = cfg.evaluation.metric.replace("accuracy_", "")
    s = asdict(summary)
    lines = [
        f"# GRPO pipeline: {cfg.trainer.project_name} / {cfg.trainer.experiment_name}",
        "",
        "| | value |",
        "|---|---|",
        f"| base model accuracy (GSM8K, {metric}) | {s['accuracy_baseline']:.4f} |",
        f"| trained model accuracy | {s['accuracy']:.4f} |",
        f"| **accuracy uplift** (95% CI, exact McNemar p) | **{uplift_line(summary)}** |",
        f"| throughput (tokens/s per GPU, mean) | {s['throughput']:.1f} |",
        f"| step time (s, mean) | {s['step_seconds']:.1f} |",
        f"| steps | {s['steps']} |",
        f"| checkpoint | `{s['checkpoint']}` |",
        f"| model version | {s['model_version'] or '-'}{' (champion)' if s['champion'] else ''} |",
        f"| MLflow run | {s['mlflow_url']} |",
    ]
    if summary.moved:
        lines += [
            "",
            "What moved (95% intervals; p: exact McNemar for the paired evaluations, Welch for the reward):",
            "",
        ]
        lines += [f"- {line}" for line in summary.moved]
    return "\n".join(lines) + "\n"
