"""A pipeline run's results, recorded in its MLflow run step by step: the evaluations and training means, the
evaluated checkpoint as a logged model, the plots and figures, the evaluations' records, the registered version
with its promotion, and last the headline metrics and the report as the run's description.

Lineage (tracking/lineage.py): the run's inputs are its training and evaluation sets, named by their digest; the
evaluated checkpoint is a logged model (its step, its evaluation metrics against the evaluation set, the exported
files), and the registry version is made from it and carries the training set's digest.
"""

from dataclasses import asdict
from pathlib import Path

from grpo_core.config.schema import GRPOConfig
from grpo_core.pipeline.champion import Champion, promotion_against
from grpo_core.pipeline.register import data_tags, register_model, registered_name
from grpo_core.pipeline.report import markdown_report, uplift_text
from grpo_core.pipeline.run import pipeline_datasets, run_url, ui_url
from grpo_core.pipeline.summary import PipelineSummary, headline_metrics, summarize, training_rows
from grpo_core.tracking.lineage import EVALUATION, digest_tags, logged_model_name
from grpo_core.tracking.mlflow_run import MlflowRun
from grpo_core.tracking.plots import (
    Curves,
    before_after_figure,
    close_figure,
    eval_points,
    plot_curves,
    plot_run,
    reward_and_format_figure,
)
from grpo_core.tracking.registry import ADAPTER_BASE_TAG

NOTE_TAG = "mlflow.note.content"  # the run's description on its page


def record_results(
    run: MlflowRun,
    cfg: GRPOConfig,
    base: dict,
    trained: dict,
    checkpoint: str,
    eval_dirs: dict[str, Path],
    model_dir: Path | None,
    champion_version: str | None = None,
    champion_known: bool = True,
    champion_tags: dict[str, str] | None = None,
    adapter_base: str | None = None,
) -> PipelineSummary:
    """Log the evaluations, uplift, summaries, plots, eval samples and the evaluated checkpoint as a logged model
    (at the last step: the checkpoint the pipeline evaluates is the one its training ended with); register it as
    champion or challenger against ``eval_dirs["champion"]`` (the evaluation of registry version
    ``champion_version``, whose tags ``champion_tags`` record the evaluation set it was judged on), or against the
    base model when there is no champion yet. When the registry could not be read (``champion_known`` false)
    nothing is promoted. A LoRA run's ``model_dir`` is its PEFT adapter directory, and ``adapter_base`` the model
    it adapts (``ADAPTER_BASE_TAG`` on the version: a warm start from it loads that base, then the adapter)."""
    rows = training_rows(cfg.trainer.default_local_dir)
    summary = summarize(cfg, rows, base, trained, checkpoint, eval_dirs, run.run_id)
    log_evaluations(run, base, summary)
    files = model_dir if model_dir is not None and cfg.tracking.log_model else None
    logged = log_evaluated_checkpoint(run, cfg, checkpoint, summary.steps, checkpoint_metrics(summary, trained), files)
    log_plots(run, cfg, rows, summary)
    for name, directory in eval_dirs.items():
        run.log_artifact(directory, f"eval/{name}")
    if files is not None:
        champion = Champion(champion_version, champion_tags, champion_known)
        register_trained(run, cfg, summary, eval_dirs, files, logged, champion, adapter_base)
    finish_record(run, cfg, summary)
    return summary


def log_evaluations(run: MlflowRun, base: dict, summary: PipelineSummary) -> None:
    """The base model's evaluation and the training's means, at the last step (the trained model's numbers go with
    its logged model: ``checkpoint_metrics``)."""
    run.log_metrics(
        {
            "val/accuracy_baseline": summary.accuracy_baseline,
            "perf/throughput_mean": summary.throughput,
            "timing/step_mean": summary.step_seconds,
            **{f"eval/base/{k}": v for k, v in base.items()},
        },
        step=summary.steps,
    )


def checkpoint_metrics(summary: PipelineSummary, trained: dict) -> dict[str, float]:
    """The evaluated checkpoint's numbers: logged to the run too, linked to the logged model and the evaluation set."""
    low, high = summary.uplift_ci95
    return {
        "val/accuracy": summary.accuracy,
        "val/accuracy_uplift": summary.accuracy_uplift,
        "val/accuracy_uplift_ci95_low": low,
        "val/accuracy_uplift_ci95_high": high,
        "val/accuracy_uplift_p_value": summary.uplift_p_value,
        **{f"eval/trained/{k}": v for k, v in trained.items()},
    }


def log_evaluated_checkpoint(
    run: MlflowRun, cfg: GRPOConfig, checkpoint: str, step: int, metrics: dict[str, float], files: Path | None
) -> tuple[str, dict[str, str]]:
    """The checkpoint as the run's logged model at ``step``: ``metrics`` against the evaluation set, tagged with
    both sets' digests, holding ``files`` (the exported model) when given. Its name and the digest tags."""
    datasets = pipeline_datasets(cfg)
    digests = digest_tags(datasets)
    evaluation = datasets[EVALUATION]
    link = {"name": evaluation["name"], "digest": evaluation["digest"]} if evaluation else None
    name, tags = logged_model_name(checkpoint), {"grpo.checkpoint": str(checkpoint), "grpo.step": str(step)}
    run.log_checkpoint_model(name, step, tags | digests, metrics, dataset=link, files=str(files) if files else None)
    return name, digests


def log_plots(run: MlflowRun, cfg: GRPOConfig, rows: list[dict], summary: PipelineSummary) -> None:
    """The run's plots (``plots/``: reward, throughput, accuracy, the curves) and its page's figures."""
    plots_dir = Path(cfg.trainer.default_local_dir) / "plots"
    plots = plot_run(rows, plots_dir, summary.accuracy_baseline, summary.accuracy)
    reward = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    accuracy = eval_points(summary.accuracy_baseline, summary.accuracy, summary.questions, max(summary.steps, 1))
    plots.append(plot_curves([Curves(cfg.trainer.experiment_name, reward, accuracy)], plots_dir / "curves.png"))
    for path in plots:
        run.log_artifact(path, "plots")
    log_figures(run, rows, summary)


def log_figures(run: MlflowRun, rows: list[dict], summary: PipelineSummary) -> None:
    """The run page's figures (``figures/``): reward and format rate per step, and accuracy and format rate
    before and after with their intervals."""
    n = max(summary.questions, 1)
    before = {"accuracy": (summary.accuracy_baseline, n), "format rate": (summary.format_rate[0], n)}
    after = {"accuracy": (summary.accuracy, n), "format rate": (summary.format_rate[1], n)}
    title = f"GSM8K before and after training: accuracy uplift {uplift_text(asdict(summary))}"
    for name, figure in (
        ("reward_and_format_rate.png", reward_and_format_figure(rows)),
        ("before_after.png", before_after_figure(before, after, title)),
    ):
        try:
            run.log_figure(figure, f"figures/{name}")
        finally:
            close_figure(figure)


def register_trained(
    run: MlflowRun,
    cfg: GRPOConfig,
    summary: PipelineSummary,
    eval_dirs: dict[str, Path],
    model_dir: Path,
    logged: tuple[str, dict[str, str]],
    champion: Champion,
    adapter_base: str | None,
) -> None:
    """Register ``model_dir`` from the run's logged model (``logged``: its name and the datasets' digest tags) as
    champion or challenger against ``champion``; the outcome into ``summary`` and the run's tags."""
    promotion = promotion_against(cfg, eval_dirs, champion)
    model_name, digests = logged
    checkpoint = Path(summary.checkpoint)
    lineage = {**digests, **data_tags(checkpoint, eval_dirs["trained"])}
    if adapter_base is not None:
        lineage[ADAPTER_BASE_TAG] = adapter_base
    summary.model_version, promotion = register_model(run, cfg, model_dir, promotion, checkpoint, model_name, lineage)
    summary.champion, summary.promotion = promotion.promoted, promotion.alias
    summary.promotion_reason = promotion.reason
    summary.compared_with = promotion.against
    summary.compared_uplift, summary.compared_p_value = promotion.uplift, promotion.p_value
    run.set_tags(promotion.tags())
    if summary.model_version and summary.model_version != "pending":
        page = f"#/models/{registered_name(cfg)}/versions/{summary.model_version}"
        summary.model_version_url = ui_url(run.shown_uri, page)


def finish_record(run: MlflowRun, cfg: GRPOConfig, summary: PipelineSummary) -> None:
    """The run's link into ``summary``; the headline metrics, and the report as the run's description."""
    summary.mlflow_url = run_url(run)
    run.log_metrics(headline_metrics(summary), step=summary.steps)
    report = markdown_report(summary, cfg)
    run.set_tags({"grpo.steps": str(summary.steps), "grpo.champion": str(summary.champion).lower(), NOTE_TAG: report})
