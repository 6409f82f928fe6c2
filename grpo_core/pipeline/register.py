"""The registry's side of a pipeline run: what it versions (the exported model, or a LoRA run's adapter), the tags
a version carries (where it came from, which data trained it and which questions judged it), and the base model
registered as the first champion on a registered model's first run.

Lineage (tracking/lineage.py): the version is made from the run's logged model (the evaluated checkpoint) and
carries the training set's digest.
"""

from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.checkpoint.manager import HF_EXPORT, STATE_FILE, read_trainer_state
from grpo_core.config.schema import GRPOConfig
from grpo_core.evaluation.gsm8k import read_eval_set
from grpo_core.evaluation.run import exported_model
from grpo_core.pipeline.promotion import BASE_TAG, CHAMPION, Promotion, eval_set_tags
from grpo_core.pipeline.report import Where
from grpo_core.tracking.mlflow_run import MlflowRun, quick_http, tracking_uri, training_experiment
from grpo_core.tracking.registry import MODEL_DIGEST_TAG, files_digest, provenance_tags

if TYPE_CHECKING:
    from grpo_core.checks.dry_run import ResolvedRun


def registered_name(cfg: GRPOConfig) -> str:
    """The registered model a pipeline run versions: ``tracking.registered_model_name``, else the project's name."""
    return cfg.tracking.registered_model_name or cfg.trainer.project_name


def model_to_register(run: "ResolvedRun", checkpoint: str, where: Where) -> Path:
    """What the registry versions: the checkpoint's exported model, or a LoRA run's adapter (exported now)."""
    model_dir = Path(checkpoint) / HF_EXPORT
    if run.lora_base is not None and run.config.tracking.log_model:
        where.phase = "exporting the LoRA adapter"
        model_dir = exported_model(checkpoint, peft=True)
    return model_dir


def data_tags(checkpoint: Path, trained_eval: Path) -> dict[str, str]:
    """Which data trained a model and which questions judged it, as its version's (and run's) tags, beside the
    datasets' digests (tracking/lineage.py): the training set's rows and how many its training drew, its start
    model's included (its ``rows_seen.json`` lists them), from its checkpoint's trainer state; the evaluation set
    (``eval_set_tags``, whose question ids are the run's ``eval/trained/eval_set.json``)."""
    tags = {}
    state = read_trainer_state(checkpoint) if (checkpoint / STATE_FILE).is_file() else {}
    if data := state.get("data"):
        tags = {"grpo.train.rows": str(data["rows"])}
        tags["grpo.train.rows_seen"] = str(len(state.get("rows_seen", [])))
    if (judged := read_eval_set(trained_eval)) is not None:
        tags |= eval_set_tags(judged)
    return tags


def register_model(
    run: MlflowRun,
    cfg: GRPOConfig,
    model_dir: Path,
    promotion: Promotion,
    checkpoint: Path | None,
    model_name: str,
    lineage: dict[str, str],
) -> tuple[str, Promotion]:
    """A new registry version of the run's logged model ``model_name`` (which holds the exported files), aliased
    and tagged as ``promotion`` says, with ``lineage`` (which data trained it and which questions judged it:
    ``data_tags``) and the digests of its files and of its checkpoint's manifest (on the run too: a warm start
    from the version checks its files against them). A re-run of the same pipeline run finds its version instead
    of registering the model again; the version is "pending" while the server is away (the registration waits in
    the run's queue)."""
    name = registered_name(cfg)
    if existing := registered_version(run.client, name, run.run_id):
        return existing
    provenance = {**provenance_tags(model_dir, checkpoint), **lineage}
    run.set_tags(provenance)
    version = run.register_model(name, {**promotion.tags(), **provenance}, promotion.alias, model_name)
    return version or "pending", promotion


def registered_version(client, name: str, run_id: str) -> tuple[str, Promotion] | None:
    """The version this MLflow run registered earlier, with the promotion its tags record; None if none."""
    try:
        found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except Exception:  # noqa: BLE001  (a server that is away: the queued registration decides later)
        return None
    if not found:
        return None
    return str(found[0].version), Promotion.from_tags(found[0].tags, f"models:/{name}/{found[0].version}")


def register_base_model(cfg: GRPOConfig, base: dict, base_eval: Path) -> tuple[str, dict[str, str]] | None:
    """The first pipeline run of a registered model: the base model (``actor_rollout_ref.model.path``, a directory
    or a hub id, whose local snapshot is used) as a version, the ``champion`` to beat, so ``models:/NAME@champion``
    resolves from the first run on. Its files are a logged model's (a warm start downloads them like any version's,
    checked against its ``grpo.model_sha256``); its tags say it is the base (``BASE_TAG``: where it came from) and
    hold its evaluation (``base``: its metrics; ``base_eval``: the set that judged it). (version, tags); None when
    the registered model has versions already. Needs the server (the flow calls it once it has read the registry)."""
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelStatus
    from mlflow.exceptions import MlflowException

    from grpo_core.tracking.lineage import link_version
    from grpo_core.tracking.mlflow_run import default_tracking_uri

    quick_http()
    uri, name = tracking_uri(cfg), registered_name(cfg)
    client = MlflowClient(uri, registry_uri=uri)
    if client.search_model_versions(f"name = '{name}'", max_results=1):
        return None
    source = cfg.actor_rollout_ref.model.path
    files = Path(source) if Path(source).is_dir() else Path(_hub_snapshot(source))
    reason = "the base model: the first pipeline run registers it as the champion a trained model has to beat"
    tags = {
        BASE_TAG: source,
        "grpo.promotion": CHAMPION,
        "grpo.promotion_reason": reason,
        MODEL_DIGEST_TAG: files_digest(files),
        **{f"grpo.eval.{k}": f"{v:.6g}" for k, v in base.items() if isinstance(v, int | float)},
        **(eval_set_tags(judged) if (judged := read_eval_set(base_eval)) else {}),
    }
    experiment_id = training_experiment(client, cfg.trainer.project_name)
    with default_tracking_uri(uri):
        model = client.create_logged_model(experiment_id, name="base_model", tags={BASE_TAG: source})
        client.log_model_artifacts(model.model_id, str(files))
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        try:
            client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = client.create_model_version(name, f"models:/{model.model_id}", tags=tags, model_id=model.model_id)
        link_version(client, model.model_id, name, version.version)
        client.set_registered_model_alias(name, CHAMPION, version.version)
    return str(version.version), tags


def _hub_snapshot(repo_id: str) -> str:
    """The local copy of a hub model the base evaluation has just read (no download)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, local_files_only=True)
