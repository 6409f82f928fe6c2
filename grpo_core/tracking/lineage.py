"""Lineage in MLflow: a pipeline run's datasets (its Datasets panel) and its evaluated checkpoint as a logged model.

Both are queued like every other call of the run (mlflow_run.py): their arguments are plain JSON when queued
(so they wait in the pending file and ``grpo tracking sync`` replays them), and become MLflow entities only
when sent. Each operation is idempotent: a replay, or a re-run of the pipeline recording its results again,
finds what the first call made instead of making it twice.

A dataset is named by ``dataset_digest`` (grpo_core/data/lineage.py), the value the prepare record, the model
version's ``grpo.train_data_digest`` tag and the metrics' dataset links all carry. Its source is where the rows
came from when the prepare record describes the file (the hub id at its commit), else the file itself.
"""

import json
import logging
import re
from pathlib import Path

from grpo_core.data.lineage import dataset_digest, record_of

logger = logging.getLogger(__name__)
TRAINING, EVALUATION = "training", "evaluation"  # MLflow's dataset contexts
CONTEXT_TAG = "mlflow.data.context"
MODEL_VERSIONS_TAG = "mlflow.modelVersions"  # on a logged model: the registry versions made from it
DIGEST_TAGS = {TRAINING: "grpo.train_data_digest", EVALUATION: "grpo.eval_data_digest"}  # a dataset's digest, as a tag
TRAIN_DATA_TAG = DIGEST_TAGS[TRAINING]


def dataset_entry(files: list[str], context: str) -> dict | None:
    """The MLflow dataset of ``files`` in ``context`` as plain JSON (name, digest, source, source type, profile);
    None when one of them is missing (nothing to name)."""
    paths = [Path(f) for f in files]
    if not paths or not all(p.is_file() for p in paths):
        return None
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource

    record = record_of(paths[0]) if len(paths) == 1 else None
    if record is not None and record["source_kind"] == "hub":
        source = HuggingFaceDatasetSource(record["source"], "main", split=record["split"], revision=record["revision"])
    else:
        source = LocalArtifactDatasetSource(str(paths[0].resolve() if len(paths) == 1 else paths[0].parent.resolve()))
    if record is not None:
        name = f"{Path(record['data_source'] or 'data').name}-{record['split']}"
        profile = {"num_rows": record["rows"], "num_skipped": record["skipped"], "prepared_from": record["source"]}
        profile |= {"revision": record["revision"]} if record["revision"] else {}
    else:
        name, profile = "+".join(p.stem for p in paths), {"files": [str(p) for p in paths]}
    entry = MetaDataset(source, name=name, digest=dataset_digest(paths)).to_dict()
    return {**entry, "profile": json.dumps(profile), "context": context}


def digest_tags(datasets: dict[str, dict | None]) -> dict[str, str]:
    """``DIGEST_TAGS`` of the datasets there are, by context."""
    return {DIGEST_TAGS[context]: d["digest"] for context, d in datasets.items() if d is not None}


def log_datasets(client, run_id: str, datasets: list[dict]) -> None:
    """The run's dataset inputs, each with its context tag (MLflow keeps one input per dataset and run)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    fields = ("name", "digest", "source_type", "source", "profile")
    inputs = [
        DatasetInput(Dataset(**{k: d.get(k) for k in fields}), tags=[InputTag(CONTEXT_TAG, d["context"])])
        for d in datasets
    ]
    client.log_inputs(run_id, datasets=inputs)


def logged_model_name(checkpoint: str | Path) -> str:
    """The checkpoint directory's name (``step_000002``) in the characters MLflow allows in a model's name."""
    return re.sub(r"[/:.%\"']", "_", Path(checkpoint).name) or "checkpoint"


def find_logged_model(client, experiment_id: str, run_id: str, name: str):
    """The logged model named ``name`` that run ``run_id`` made, or None."""
    query = f"source_run_id = '{run_id}' AND name = '{name}'"
    found = client.search_logged_models([experiment_id], filter_string=query, max_results=1)
    return found[0] if found else None


def log_checkpoint_model(
    client,
    run_id: str,
    name: str,
    step: int,
    tags: dict[str, str],
    metrics: dict[str, float],
    timestamp: int,
    dataset: dict | None = None,
    files: str | None = None,
) -> str:
    """The evaluated checkpoint as a logged model of the run: found by (run, name) or created; the run's output at
    ``step``; ``metrics`` logged to the run and the model, against ``dataset`` (name and digest of the evaluation
    set); ``files`` (the exported model) as its artifacts, then READY. Its id."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric

    run = client.get_run(run_id)
    model = find_logged_model(client, run.info.experiment_id, run_id, name)
    if model is None:
        model = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id, tags=tags)
    if model.model_id not in {o.model_id for o in (run.outputs.model_outputs if run.outputs else [])}:
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    link = {"dataset_name": dataset["name"], "dataset_digest": dataset["digest"]} if dataset else {}
    batch = [Metric(k, float(v), timestamp, step, model_id=model.model_id, **link) for k, v in metrics.items()]
    client.log_batch(run_id, metrics=batch)
    if model.status != LoggedModelStatus.READY:
        if files is not None and Path(files).is_dir():
            client.log_model_artifacts(model.model_id, files)
        elif files is not None:
            logger.warning("logged model %s: %s no longer exists; the model has no files", name, files)
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return model.model_id


def link_version(client, model_id: str, name: str, version: str) -> None:
    """Name the registry version on the logged model it was made from, as an MLflow server does itself (a local
    store does not): the model's page then lists it."""
    entry = {"name": name, "version": int(version)}
    listed = json.loads(client.get_logged_model(model_id).tags.get(MODEL_VERSIONS_TAG) or "[]")
    if all((str(e.get("name")), str(e.get("version"))) != (name, str(version)) for e in listed):
        client.set_logged_model_tags(model_id, {MODEL_VERSIONS_TAG: json.dumps([*listed, entry])})
