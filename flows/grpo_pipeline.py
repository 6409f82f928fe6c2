"""prepare → evaluate the base model → train → evaluate the trained model → report the uplift.

Run it with ``grpo pipeline --config configs/demo_cpu.yaml`` (Prefect's ephemeral API, nothing to start),
or deploy it with ``prefect deploy`` (prefect.yaml) and run ``prefect deployment run 'grpo-pipeline/on-demand'``.
Every task is cached and its result persisted: a re-run after a crash picks up after the last finished
task, and the training task itself resumes from its last checkpoint.

The flow is a recipe over grpo_core/pipeline/ (skip unchanged inputs, evaluate, compare with the champion, register,
report); what is Prefect's stays here: the tasks and their caches, the report artifact, the flow run's log and the
run directory held for the flow run.
"""

from dataclasses import asdict
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from grpo_core.checkpoint.manager import CheckpointManager
from grpo_core.config.schema import GRPOConfig
from grpo_core.evaluation.gsm8k import METRICS_FILE
from grpo_core.launch import run_lock
from grpo_core.pipeline.champion import Log, judge_with_champion
from grpo_core.pipeline.evaluations import Evaluations, start_model_files
from grpo_core.pipeline.inputs import run_inputs, unchanged_since
from grpo_core.pipeline.notices import failure_notice, regression_notice
from grpo_core.pipeline.record import record_results
from grpo_core.pipeline.register import model_to_register
from grpo_core.pipeline.report import REPORT_KEY, Where, markdown_report, skipped_report, uplift_line
from grpo_core.pipeline.run import log_pipeline_datasets, open_run
from grpo_core.pipeline.start import resolve_pipeline_run
from grpo_core.quiet import LOG_ONLY
from tasks import evaluate_checkpoint, prepare_gsm8k, train_task, unless_missing

_held: dict[str, Path] = {}  # flow run id -> the run directory it holds
FAILED_IN = "the pipeline failed in: "
"""The note (``add_note``) on the exception a flow run fails with, naming its phase: `grpo pipeline`'s one line says
it (flows/command.py), and the traceback in the log ends with it."""


def hold_run_dir(run_dir: Path) -> None:
    """One run at a time in a run directory (grpo_core/launch/run_lock.py); let go by ``_let_go`` however the
    flow run ends. A busy directory fails the flow run at once, naming the holder."""
    run_lock.acquire(run_dir, flow_run=str(flow_run.id))
    _held[str(flow_run.id)] = run_dir


def _let_go(flow, run, state) -> None:
    if (run_dir := _held.pop(str(run.id), None)) is not None:
        run_lock.release(run_dir)


@flow(
    name="grpo-pipeline",
    log_prints=True,
    on_completion=[_let_go],
    on_failure=[_let_go],
    on_crashed=[_let_go],
    on_cancellation=[_let_go],
)
def grpo_pipeline(
    config: str | None = None,
    overrides: list[str] | None = None,
    fresh: bool = False,
    start_from_champion: bool = False,
    skip_unchanged: bool = False,
) -> dict:
    """GRPO on GSM8K with the accuracy before and after, tracked in one MLflow run; the new model version
    becomes the registry's champion only when it beats the current one (see grpo_core/pipeline/promotion.py).

    ``start_from_champion``: train from ``models:/NAME@champion`` when there is one (else the config's model).
    ``skip_unchanged``: a scheduled run; when its start model version, training data and resolved config are
    those of the last finished scheduled run, train nothing; either way say which of them changed.

    Whatever happens, the flow run's report artifact says it: the results, or where the run failed and why (and a
    failure is sent as a notice when ``tracking.notify_*`` names where)."""
    where = Where()
    try:
        return run_pipeline(where, config, overrides, fresh, start_from_champion, skip_unchanged)
    except Exception as e:
        report = where.failure_report(flow_run.name, e)
        create_markdown_artifact(report, key=REPORT_KEY, description=f"failed in {where.phase}")
        failure_notice(where, flow_run.name, report)
        e.add_note(f"{FAILED_IN}{where.phase}")
        raise


def run_pipeline(
    where: Where,
    config: str | None = None,
    overrides: list[str] | None = None,
    fresh: bool = False,
    start_from_champion: bool = False,
    skip_unchanged: bool = False,
) -> dict:
    """The flow's body (``grpo_pipeline``'s arguments), saying in ``where`` which phase it is in."""
    log = get_run_logger()
    fresh_start = flow_run.scheduled_start_time if fresh else None  # names a fresh run's own directory
    run, overrides = resolve_pipeline_run(where, config, list(overrides or []), start_from_champion, fresh_start, log)
    cfg = run.config
    where.phase = "prepare (the data)"
    prepare(cfg, log)
    inputs, changed = run_inputs(run), ""
    if skip_unchanged:
        where.phase = "comparing with the last scheduled run"
        same_as, changed = unchanged_since(cfg, inputs)  # which of data, config and start model changed
        log.info(changed)
        if same_as is not None:
            return skipped(where.title, changed, same_as)

    where.phase = "opening the MLflow run"
    hold_run_dir(Path(cfg.trainer.default_local_dir))  # from here on the run directory is written: one run at a time
    flow_tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_name": str(flow_run.name)}
    mlflow_run = open_run(run, inputs, skip_unchanged, flow_tags)
    where.mlflow_url = "" if mlflow_run.is_deferred else f"{mlflow_run.shown_uri} run {mlflow_run.run_id}"
    log_pipeline_datasets(mlflow_run, cfg)  # the run page's Datasets panel: training and evaluation sets
    evals = Evaluations.for_run(run)
    try:
        where.phase = "evaluate base (the start model)"
        base = evaluate(start_model_files(run), evals.dirs["base"], evals)
        where.phase = "train"
        checkpoint = train(cfg, config, overrides, mlflow_run.run_id)
        where.phase = "evaluate trained (the checkpoint)"
        trained = evaluate(checkpoint, evals.dirs["trained"], evals, checkpoint)
        champion = judge_with_champion(cfg, where, base, evals, lambda model, out: evaluate(model, out, evals), log)
        model_dir = model_to_register(run, checkpoint, where)
        where.phase = "recording the results in MLflow"
        summary = record_results(
            mlflow_run,
            cfg,
            base,
            trained,
            checkpoint,
            evals.dirs,
            model_dir,
            champion_version=champion.version,
            champion_known=champion.known,
            champion_tags=champion.tags,
            adapter_base=run.lora_base,
        )
    except BaseException:
        mlflow_run.finish("FAILED")  # a re-run with the same key continues this run
        mlflow_run.close()
        raise
    report = markdown_report(summary, cfg)
    create_markdown_artifact(report, key=REPORT_KEY, description="accuracy, uplift, promotion and throughput")
    if skip_unchanged:
        regression_notice(where, flow_run.name, asdict(summary), report, cfg.tracking.champion_alpha)
    mlflow_run.finish()
    mlflow_run.close()
    # one line, in the flow's log (a deployment's run shows the report as an artifact); `grpo pipeline` prints it in
    # its summary, so its terminal does not show it twice
    accuracy = summary.accuracy_baseline, summary.accuracy, uplift_line(summary)
    log.info("accuracy %.4f -> %.4f, uplift %s", *accuracy, extra={LOG_ONLY: True})
    return {**asdict(summary), "prefect_flow_run_id": str(flow_run.id), "inputs": changed}


def skipped(title: str, reason: str, last_run_id: str) -> dict:
    """The report artifact and the flow's result of a scheduled run that trains nothing (``reason`` says why)."""
    create_markdown_artifact(skipped_report(title, reason), key=REPORT_KEY)
    return {"skipped": True, "reason": reason, "mlflow_run_id": last_run_id, "prefect_flow_run_id": str(flow_run.id)}


def prepare(cfg: GRPOConfig, log: Log) -> None:
    """The prepare task, run again when one of the data files is gone; a line of its row counts."""
    data_dir = Path(cfg.data.train_files[0]).parent
    data = unless_missing(prepare_gsm8k, *cfg.data.train_files, *cfg.data.val_files)(cfg.data.source, str(data_dir))
    log.info("data: %s in %s", ", ".join(f"{n} {split} rows" for split, n in data["rows"].items()), data_dir)


def evaluate(model: str, out_dir: Path, evals: Evaluations, *inputs: str) -> dict:
    """The evaluate task into ``out_dir`` on ``evals``' file and settings, run again when its metrics file (or
    one of ``inputs``) is gone."""
    task = unless_missing(evaluate_checkpoint, out_dir / METRICS_FILE, *inputs)
    return task(model, evals.file, str(out_dir), evals.settings)


def train(cfg: GRPOConfig, config: str | None, overrides: list[str], mlflow_run_id: str) -> str:
    """The train task with the config's retries, logging into the pipeline's MLflow run; the checkpoint it ended
    with. Its cache is ignored while the run directory holds no checkpoint (a cached result would name one)."""
    no_checkpoint = CheckpointManager.for_run(cfg.trainer).latest() is None
    return train_task(cfg, refresh_cache=no_checkpoint)(config, overrides, mlflow_run_id)["checkpoint"]
