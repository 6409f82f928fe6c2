"""The pipeline's MLflow run: one per pipeline key (inputs.py), so a re-run after a crash finds and continues the
same run instead of starting a second one. The trainer logs its per-step metrics into it (``GRPO_MLFLOW_RUN_ID``);
the pipeline adds the evaluations, the uplift, the plots and the registered model (record.py).

A server that is down when the pipeline starts does not stop it: the run is *deferred* (tracking/mlflow_run.py),
every call waits in the queue, and is sent when the server answers or written to the run's pending file
for ``grpo tracking sync``.
"""

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.config.load import to_flat_dict, to_yaml
from grpo_core.config.schema import GRPOConfig
from grpo_core.config.secrets import hide_url_passwords
from grpo_core.pipeline.evaluations import evaluation_file
from grpo_core.pipeline.inputs import INPUTS_TAG, SCHEDULED_TAG, inputs_key, pipeline_key
from grpo_core.tracking.lineage import EVALUATION, TRAINING, dataset_entry
from grpo_core.tracking.mlflow_run import KEY_TAG, MlflowRun, quick_http, tracking_uri, training_experiment
from grpo_core.tracking.sync import PENDING_FILE

if TYPE_CHECKING:
    from grpo_core.checks.dry_run import ResolvedRun

logger = logging.getLogger(__name__)


def open_run(run: "ResolvedRun", inputs: dict[str, str], scheduled: bool, flow_tags: dict[str, str]) -> MlflowRun:
    """The pipeline's MLflow run, tagged with the flow run (``flow_tags``), its inputs' key and what it started
    from; a re-run with the same key continues it."""
    cfg = run.config
    tags = {**flow_tags, INPUTS_TAG: inputs_key(cfg), **inputs, SCHEDULED_TAG: str(scheduled).lower()}
    if run.start_model is not None:
        tags["grpo.start_model"] = run.start_model.canonical
    return open_pipeline_run(cfg, pipeline_key(cfg), tags, Path(cfg.trainer.default_local_dir))


def open_pipeline_run(cfg: GRPOConfig, key: str, tags: dict[str, str], local_dir: Path) -> MlflowRun:
    """The pipeline's MLflow run: the unfinished or finished one with this key, else a new one; a deferred
    one (created when the server answers) when the server is down now."""
    quick_http()  # a server that is down costs the pipeline seconds, not minutes of retries
    t, uri = cfg.trainer, tracking_uri(cfg)
    pending = local_dir / PENDING_FILE
    try:
        run = _found_run(uri, t.project_name, key, pending)
    except Exception as e:  # noqa: BLE001  (any transport or server error: train now, track when it answers)
        logger.warning(
            "MLflow at %s does not answer (%s); training goes on and its tracking is sent when the server is "
            "back, else kept in %s",
            hide_url_passwords(uri),
            str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__,
            pending,
        )
        tags = {"mlflow.runName": t.experiment_name, **tags}
        run = MlflowRun.deferred(uri, t.project_name, key, tags, pending_file=pending)
    else:
        if run is not None:
            run.set_tags(tags)
            run.set_status("RUNNING")
            return run
        run = MlflowRun.create(uri, t.project_name, t.experiment_name, {KEY_TAG: key, **tags}, pending_file=pending)
    run.log_params(to_flat_dict(cfg))
    local_dir.mkdir(parents=True, exist_ok=True)
    resolved = local_dir / "resolved_config.yaml"
    resolved.write_text(to_yaml(cfg))  # secrets as *** (config/secrets.py), as in the params
    run.log_artifact(resolved)
    return run


def _found_run(uri: str, experiment_name: str, key: str, pending: Path) -> MlflowRun | None:
    """The run of ``experiment_name`` tagged with ``key``, or None; raises when the server does not answer."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    if client.get_experiment_by_name(experiment_name) is None:
        return None
    experiment_id = training_experiment(client, experiment_name)  # first used by the project: tagged now
    found = client.search_runs([experiment_id], f"tags.`{KEY_TAG}` = '{key}'", max_results=1)
    return MlflowRun(uri, found[0].info.run_id, pending_file=pending) if found else None


def run_url(run: MlflowRun) -> str:
    """A link to the run in the MLflow UI (for a local store: the UI to start, then the link); what to run
    when the run is not on the server yet."""
    try:
        info = run.client.get_run(run.run_id).info if run.flush() else None
    except Exception:  # noqa: BLE001  (the server went away since the flush)
        info = None
    if info is None:
        where = run.pending_file.parent if run.pending_file else "RUN_DIR"
        return f"not sent yet: MLflow at {run.shown_uri} is unreachable (`grpo tracking sync {where}` sends it)"
    # the model-training view: MLflow 3's UI opens a run in its GenAI view unless told (it keeps the last choice)
    return ui_url(run.shown_uri, f"#/experiments/{info.experiment_id}/runs/{run.run_id}?workflowType=machine_learning")


def ui_url(shown_uri: str, path: str) -> str:
    """``path`` in the MLflow UI of tracking URI ``shown_uri`` (for a local store: the UI to start, then the link)."""
    if shown_uri.startswith(("http://", "https://")):
        return f"{shown_uri.rstrip('/')}/{path}"
    return f"`mlflow ui --backend-store-uri {shown_uri}` then http://127.0.0.1:5000/{path}"


def pipeline_datasets(cfg: GRPOConfig) -> dict[str, dict | None]:
    """The training and evaluation sets as MLflow datasets (lineage.dataset_entry), by context."""
    return {
        TRAINING: dataset_entry(cfg.data.train_files, TRAINING),
        EVALUATION: dataset_entry([evaluation_file(cfg)], EVALUATION),
    }


def log_pipeline_datasets(run: MlflowRun, cfg: GRPOConfig) -> None:
    """The run page's Datasets panel: both sets, with their digests, sources and contexts."""
    if datasets := [d for d in pipeline_datasets(cfg).values() if d is not None]:
        run.log_datasets(datasets)
