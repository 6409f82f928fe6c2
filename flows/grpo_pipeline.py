"""prepare → evaluate the base model → train → evaluate the trained model → report the uplift.

Run it with ``grpo pipeline --config configs/demo_cpu.yaml`` (Prefect's ephemeral API, nothing to start),
or deploy it with ``prefect deploy`` (prefect.yaml) and run ``prefect deployment run 'grpo-pipeline/on-demand'``.
Every task is cached and its result persisted: a re-run after a crash picks up after the last finished
task, and the training task itself resumes from its last checkpoint.
"""

from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from grpo_core.config import ConfigError
from grpo_core.config.load import load_config
from grpo_core.data.lineage import dataset_digest
from grpo_core.evaluation.gsm8k import METRICS_FILE, read_eval_set
from grpo_core.evaluation.run import EvalSettings, exported_model
from grpo_core.launch import run_lock
from grpo_core.quiet import LOG_ONLY
from grpo_core.tracking.mlflow_run import quick_http, tracking_uri
from grpo_core.tracking.notify import regression, send_notice
from grpo_core.tracking.promotion import eval_set_tags, judge_note
from grpo_core.tracking.registry import (
    RegistryModel,
    RegistryUnreachable,
    champion_uri,
    eval_dir,
    fetch_model,
    full_model,
)
from grpo_core.tracking.report import REPORT_KEY, failure_report, one_line
from grpo_core.trainer.checkpoint import HF_EXPORT, CheckpointManager
from grpo_core.trainer.dry_run import resolve_run
from tasks import evaluate_checkpoint, prepare_gsm8k, train_task, unless_missing
from tasks.evaluate import settings_dict


def fresh_overrides(cfg_dir: str) -> list[str]:
    """A fresh run (scheduled retraining) trains in its own directory, named by the flow run's scheduled
    start, so a retry of that flow run finds the same directory and resumes there."""
    start = flow_run.scheduled_start_time
    return [f"trainer.default_local_dir={Path(cfg_dir) / start.strftime('%Y%m%d-%H%M%S')}"]


def current_champion(cfg) -> str | None:
    """``models:/NAME@champion`` of ``tracking.registered_model_name`` when that alias exists, else None."""
    from mlflow import MlflowClient

    quick_http()
    server = tracking_uri(cfg)
    return champion_uri(MlflowClient(server, registry_uri=server), server, registered_name(cfg))


def champion_model(cfg) -> RegistryModel | None:
    """The registry's current champion, fetched; None while there is none."""
    uri = current_champion(cfg)
    return fetch_model(uri, tracking_uri(cfg), cfg.tracking.model_cache_dir) if uri else None


def registered_name(cfg) -> str:
    return cfg.tracking.registered_model_name or cfg.trainer.project_name


_held: dict[str, Path] = {}  # flow run id -> the run directory it holds


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
    becomes the registry's champion only when it beats the current one (see grpo_core/tracking/promotion.py).

    ``start_from_champion``: train from ``models:/NAME@champion`` when there is one (else the config's model).
    ``skip_unchanged``: a scheduled run; when its start model version, training data and resolved config are
    those of the last finished scheduled run, train nothing; either way say which of them changed.

    Whatever happens, the flow run's report artifact says it: the results, or where the run failed and why (and a
    failure is sent as a notice when ``tracking.notify_*`` names where)."""
    where = Where()
    try:
        return run_pipeline(where, config, overrides, fresh, start_from_champion, skip_unchanged)
    except Exception as e:
        title = where.title or f"flow run {flow_run.name}"
        report = failure_report(title, where.phase, one_line(e), where.mlflow_url)
        create_markdown_artifact(report, key=REPORT_KEY, description=f"failed in {where.phase}")
        if where.notify:
            subject = f"GRPO pipeline {title}: flow run {flow_run.name} failed in {where.phase}"
            send_notice(subject, f"{subject}\n\n{report}", *where.notify)
        raise


@dataclass
class Where:
    """How far a flow run got: the phase it is in (the task running, or the step between tasks), and what a
    failure report names."""

    phase: str = "loading the config"
    title: str = ""
    mlflow_url: str = ""
    notify: tuple[str | None, str | None] | None = None  # (webhook URL, block name) once the config is read


def run_pipeline(
    where: Where,
    config: str | None = None,
    overrides: list[str] | None = None,
    fresh: bool = False,
    start_from_champion: bool = False,
    skip_unchanged: bool = False,
) -> dict:
    """The flow's body (``grpo_pipeline``'s arguments), saying in ``where`` which phase it is in."""
    from grpo_core.tracking.pipeline_run import (
        evaluation_file,
        inputs_verdict,
        last_scheduled_run,
        log_pipeline_datasets,
        markdown_report,
        record_results,
        scheduled_inputs,
        uplift_line,
    )

    log = get_run_logger()
    run, overrides = resolve_pipeline_run(where, config, list(overrides or []), fresh, start_from_champion)
    cfg = run.config
    run_dir = Path(cfg.trainer.default_local_dir)

    data_dir = Path(cfg.data.train_files[0]).parent
    where.phase = "prepare (the data)"
    data = unless_missing(prepare_gsm8k, *cfg.data.train_files, *cfg.data.val_files)(cfg.data.source, str(data_dir))
    log.info("data: %s in %s", ", ".join(f"{n} {split} rows" for split, n in data["rows"].items()), data_dir)
    eval_file = evaluation_file(cfg)

    start = run.start_model.canonical if run.start_model else cfg.actor_rollout_ref.model.path
    inputs, changed = scheduled_inputs(cfg, start), ""
    if skip_unchanged:
        where.phase = "comparing with the last scheduled run"
        last = last_scheduled_run(cfg)
        unchanged, changed = inputs_verdict(last, inputs)  # which of data, config and start model changed
        log.info(changed)
        if unchanged:
            create_markdown_artifact(f"# GRPO pipeline: {where.title}: skipped\n\n{changed}\n", key=REPORT_KEY)
            flow_id = str(flow_run.id)
            return {"skipped": True, "reason": changed, "mlflow_run_id": last[0], "prefect_flow_run_id": flow_id}

    where.phase = "opening the MLflow run"
    hold_run_dir(run_dir)  # from here on the run directory is written: one run at a time
    mlflow_run = open_flow_mlflow_run(run, inputs, skip_unchanged)
    where.mlflow_url = "" if mlflow_run.is_deferred else f"{mlflow_run.shown_uri} run {mlflow_run.run_id}"
    log_pipeline_datasets(mlflow_run, cfg)  # the run page's Datasets panel: training and evaluation sets
    settings = settings_dict(EvalSettings.from_config(cfg))
    data_digest = dataset_digest([eval_file])  # the evaluation set's: a champion's evaluation is kept per set
    eval_dirs = {"base": run_dir / "eval" / "base", "trained": run_dir / "eval" / "trained"}
    if run.start_model is not None:  # kept with the version: a champion start is evaluated once
        eval_dirs["base"] = eval_dir(run.start_model, data_digest, settings)

    try:
        where.phase = "evaluate base (the start model)"
        start_files = cfg.actor_rollout_ref.model.path
        if run.start_model is not None and run.start_model.is_adapter:  # the base with the adapter merged in
            start_files = str(full_model(run.start_model, tracking_uri(cfg), cfg.tracking.model_cache_dir))
        evaluate_base = unless_missing(evaluate_checkpoint, eval_dirs["base"] / METRICS_FILE)
        base = evaluate_base(start_files, eval_file, str(eval_dirs["base"]), settings)
        no_checkpoint = CheckpointManager.for_run(cfg.trainer).latest() is None
        where.phase = "train"
        trained_run = train_task(cfg, refresh_cache=no_checkpoint)(config, overrides, mlflow_run.run_id)
        checkpoint = trained_run["checkpoint"]
        where.phase = "evaluate trained (the checkpoint)"
        evaluate_trained = unless_missing(evaluate_checkpoint, eval_dirs["trained"] / METRICS_FILE, checkpoint)
        trained = evaluate_trained(checkpoint, eval_file, str(eval_dirs["trained"]), settings)

        champion = judge_with_champion(cfg, where, base, eval_dirs, eval_file, data_digest, settings)

        model_dir = Path(checkpoint) / HF_EXPORT  # what the registry versions: the model, or a LoRA run's adapter
        if run.lora_base is not None and cfg.tracking.log_model:
            where.phase = "exporting the LoRA adapter"
            model_dir = exported_model(checkpoint, peft=True)
        where.phase = "recording the results in MLflow"
        summary = record_results(
            mlflow_run,
            cfg,
            base,
            trained,
            checkpoint,
            eval_dirs,
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
    if skip_unchanged and (why := regression(asdict(summary), cfg.tracking.champion_alpha)):
        subject = f"GRPO pipeline {where.title}: flow run {flow_run.name}: regression, {why}"
        send_notice(subject, f"{subject}\n\n{report}", *where.notify)
    mlflow_run.finish()
    mlflow_run.close()
    # one line, in the flow's log (a deployment's run shows the report as an artifact); `grpo pipeline` prints it in
    # its summary, so its terminal does not show it twice
    accuracy = summary.accuracy_baseline, summary.accuracy, uplift_line(summary)
    log.info("accuracy %.4f -> %.4f, uplift %s", *accuracy, extra={LOG_ONLY: True})
    return {**asdict(summary), "prefect_flow_run_id": str(flow_run.id), "inputs": changed}


def resolve_pipeline_run(where: Where, config: str | None, overrides: list[str], fresh: bool, champion: bool):
    """The run every task reads (dry_run.ResolvedRun) and the overrides pinned to it: the config, the registry's
    champion as the start model when asked (else the config's model), a fresh run's own directory."""
    log = get_run_logger()
    first = load_config(config, overrides)
    where.notify = (first.tracking.notify_webhook_url, first.tracking.notify_block)
    where.title = f"{first.trainer.project_name} / {first.trainer.experiment_name}"
    if champion:
        where.phase = "reading the registry's champion"
        if (uri := current_champion(first)) is not None:
            overrides.append(f"actor_rollout_ref.model.path={uri}")
            log.info("starting from the registry's champion: %s", uri)
        else:
            log.info("no champion in the registry yet: starting from %s", first.actor_rollout_ref.model.path)
    if fresh:
        overrides += fresh_overrides(first.trainer.default_local_dir)
    run = resolve_run(config, overrides)
    if run.report.errors:
        raise ConfigError(run.report.errors, run.report.warnings)
    return run, run.pinned(overrides)  # every task reads the version resolved now


def open_flow_mlflow_run(run, inputs: dict[str, str], scheduled: bool):
    """The pipeline's MLflow run, tagged with the flow run, its inputs' key and what it started from; a re-run
    with the same key continues it."""
    from grpo_core.tracking.pipeline_run import INPUTS_TAG, SCHEDULED_TAG, inputs_key, open_pipeline_run, pipeline_key

    cfg = run.config
    tags = {
        "prefect.flow_run_id": str(flow_run.id),
        "prefect.flow_run_name": str(flow_run.name),
        INPUTS_TAG: inputs_key(cfg),
        **inputs,
        SCHEDULED_TAG: str(scheduled).lower(),
    }
    if run.start_model is not None:
        tags["grpo.start_model"] = run.start_model.canonical
    return open_pipeline_run(cfg, pipeline_key(cfg), tags, Path(cfg.trainer.default_local_dir))


@dataclass
class Champion:
    """What the new version is compared with: the registry's champion (evaluated on the same questions), the base
    model registered as the first one, or none (``known`` False: the registry was unreachable, never promote blind)."""

    version: str | None = None
    tags: dict | None = None
    known: bool = True


def judge_with_champion(
    cfg, where: Where, base: dict, eval_dirs: dict, eval_file: str, data_digest: str, settings: dict
) -> Champion:
    """The registry's champion, evaluated on the trained model's questions and settings (once per version and
    evaluation set: ``eval_dirs["champion"]``); on the first run of a registered model, the base model registered as
    version 1 and the champion, its evaluation the base one."""
    from grpo_core.tracking.pipeline_run import register_base_model

    log = get_run_logger()
    if not cfg.tracking.log_model:
        return Champion()
    where.phase = "reading the registry's champion"
    try:
        champion = champion_model(cfg)
    except RegistryUnreachable as e:  # an outage: train and evaluate anyway, never promote blind
        log.warning("%s: cannot compare with the champion; the new version will not be promoted", e)
        return Champion(known=False)
    if champion is None:  # the first run of this registered model
        where.phase = "registering the base model"
        try:
            registered = register_base_model(cfg, base, eval_dirs["base"])
        except Exception as e:  # noqa: BLE001  (the trained model is still compared with the base, as before)
            log.warning("the base model was not registered as the champion: %s", one_line(e))
            registered = None
        if registered is None:  # versions exist, none is the champion: the trained model is compared with the base
            return Champion()
        version, tags = registered
        eval_dirs["champion"] = eval_dirs["base"]  # evaluated already, on the same questions
        log.info("registered the base model as version %s, the champion to beat", version)
        return Champion(version, tags)
    if judged := read_eval_set(eval_dirs["trained"]):
        note = judge_note(champion.tags, eval_set_tags(judged), f"champion version {champion.version}")
        log.info(note or f"the evaluation set is the one champion version {champion.version} was judged on")
    eval_dirs["champion"] = eval_dir(champion, data_digest, settings)
    where.phase = f"evaluate champion (version {champion.version})"
    evaluate_champion = unless_missing(evaluate_checkpoint, eval_dirs["champion"] / METRICS_FILE)
    files = full_model(champion, tracking_uri(cfg), cfg.tracking.model_cache_dir)  # an adapter: merged into its base
    evaluate_champion(str(files), eval_file, str(eval_dirs["champion"]), settings)
    return Champion(champion.version, champion.tags)
