"""One MLflow run, written by run id through ``MlflowClient``, that survives its server going away.

Every call is queued and the queue is sent in order; when the server does not answer, the calls stay
queued (a warning says so once), are retried at the next call after ``retry_s``, and are flushed when
the server is back. Whatever cannot be sent by ``close`` (which gives an outage ``wait_s`` in all) is written
to ``pending_file`` (JSON lines of the calls) and said so, so nothing is lost; ``grpo tracking sync RUN_DIR``
(sync.py) replays it later. The HTTP client's own retries are capped so that a dead server costs a step
seconds, not minutes.

A run that could not be created (the server was down when the pipeline started) has a *deferred* id,
``pending:<pipeline key>:<experiment>``: the first flush that reaches the server finds the run carrying
that key (``KEY_TAG``) or creates it, so the pipeline, its trainer and a later sync all land in one run.
"""

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_core.config.secrets import hide_url_passwords, masked
from grpo_core.tracking.lineage import find_logged_model, link_version, log_checkpoint_model, log_datasets

logger = logging.getLogger(__name__)

RUN_ID_VAR = "GRPO_MLFLOW_RUN_ID"  # set by the pipeline: the trainer logs into the pipeline's run
KEY_TAG = "grpo.pipeline_key"  # what a pipeline's run is found by
DEFERRED = "pending:"
# Errors that say the call itself is wrong: sending it again cannot succeed, so it is dropped (with a warning).
REJECTED = {
    "INVALID_PARAMETER_VALUE",
    "BAD_REQUEST",
    "RESOURCE_ALREADY_EXISTS",
    "RESOURCE_DOES_NOT_EXIST",
    "INVALID_STATE",
    "PERMISSION_DENIED",
}
# MLflow 3 opens an experiment in its GenAI view (traces, judges) unless told it is model training: then the runs
# table, metrics and charts come first. Set when the project creates an experiment or first uses one.
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
MAX_PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch
MAX_PARAM_LENGTH = 6000


def tracking_uri(cfg) -> str:
    """The config's URI, else MLflow's own environment variable, else a SQLite file in the working directory."""
    return cfg.tracking.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


def quick_http() -> None:
    """MLflow's REST client retries 7 times with backoff by default (minutes against a dead server)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def deferred_run_id(experiment: str, key: str) -> str:
    """The id of a run to find (by ``KEY_TAG``) or create in ``experiment`` once the server answers."""
    return f"{DEFERRED}{key}:{experiment}"


def training_experiment(client, name: str) -> str:
    """The id of experiment ``name``, created if missing, tagged as model training (``EXPERIMENT_KIND_TAG``) unless
    someone chose another kind for it."""
    found = client.get_experiment_by_name(name)
    experiment_id = found.experiment_id if found else client.create_experiment(name)
    if found is None or EXPERIMENT_KIND_TAG not in (found.tags or {}):
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return experiment_id


def resolve_run_id(client, run_id: str) -> str:
    """A deferred id as the real one: the run in its experiment tagged with its key, else a new run."""
    if not run_id.startswith(DEFERRED):
        return run_id
    key, experiment = run_id[len(DEFERRED) :].split(":", 1)
    experiment_id = training_experiment(client, experiment)
    runs = client.search_runs([experiment_id], f"tags.`{KEY_TAG}` = '{key}'", max_results=1)
    if runs:
        return runs[0].info.run_id
    return client.create_run(experiment_id, tags={KEY_TAG: key}).info.run_id


def register_version(
    client, run_id: str, name: str, tags: dict[str, str], alias: str | None, model_name: str | None = None
) -> str:
    """A registry version of the run's logged model ``model_name`` (``models:/<model id>``, which the version's
    page links to), the registered model created if missing. Without ``model_name`` (a call queued before
    logged models): of the run's ``model`` artifact."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    run = client.get_run(run_id)
    model = find_logged_model(client, run.info.experiment_id, run_id, model_name) if model_name else None
    if model_name and model is None:
        raise MlflowException(f"run {run_id} has no logged model {model_name!r}", RESOURCE_DOES_NOT_EXIST)
    if model is None:
        version = client.create_model_version(name, f"{run.info.artifact_uri}/model", run_id=run_id, tags=tags)
    else:
        source = f"models:/{model.model_id}"
        version = client.create_model_version(name, source, run_id=run_id, tags=tags, model_id=model.model_id)
        link_version(client, model.model_id, name, version.version)
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return str(version.version)


# Queued calls that are not a single ``MlflowClient`` method: name -> function(client, run_id, **kwargs).
OPERATIONS = {
    "register_version": register_version,
    "log_datasets": log_datasets,
    "log_checkpoint_model": log_checkpoint_model,
}


@contextlib.contextmanager
def default_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's local (SQL) registry store looks a ``models:/<model id>`` source up through the *default* tracking
    URI, not its client's: make that this run's for the call (an MLflow server looks it up itself)."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = before


class MlflowRun:
    def __init__(self, tracking_uri: str, run_id: str, pending_file: Path | None = None, retry_s: float = 15.0):
        quick_http()
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self.pending_file, self.retry_s = pending_file, retry_s
        self.queue: list[tuple[str, dict[str, Any]]] = []
        self.results: dict[str, Any] = {}  # the last return value of each operation sent (a model version)
        self._next_try = 0.0
        self._down_since: float | None = None

    @classmethod
    def create(cls, tracking_uri: str, experiment: str, run_name: str, tags: dict[str, str] | None = None, **kw):
        """A new run in ``experiment`` (created if missing). Needs the server: fails loudly if it is down."""
        quick_http()
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri)
        experiment_id = training_experiment(client, experiment)
        run = client.create_run(experiment_id, run_name=run_name, tags=tags or {})
        return cls(tracking_uri, run.info.run_id, **kw)

    @classmethod
    def deferred(cls, tracking_uri: str, experiment: str, key: str, tags: dict[str, str], **kw) -> "MlflowRun":
        """A run created (or found by ``key``) when the server first answers; ``tags`` are its first call."""
        run = cls(tracking_uri, deferred_run_id(experiment, key), **kw)
        run.set_tags({KEY_TAG: key, **tags})
        return run

    @property
    def shown_uri(self) -> str:
        """The tracking URI as messages and the pending file show it: a database URL's password hidden."""
        return hide_url_passwords(self.tracking_uri)

    @property
    def is_deferred(self) -> bool:
        return self.run_id.startswith(DEFERRED)

    # ---- what callers log --------------------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._send("log_batch", {"metrics": batch})

    def log_params(self, params: dict[str, Any]) -> None:
        """Secret values (every ``trainer.env`` value, ``*_token``, a URL's password: config/secrets.py) are logged
        as ``***``; so the pending file never holds them either."""
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in masked(params).items()]
        for first in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self._send("log_batch", {"params": items[first : first + MAX_PARAMS_PER_BATCH]})

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._send("log_batch", {"tags": [RunTag(k, str(v)) for k, v in tags.items()]})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        method = "log_artifacts" if Path(path).is_dir() else "log_artifact"
        self._send(
            method,
            {"local_dir" if method == "log_artifacts" else "local_path": str(path), "artifact_path": artifact_path},
        )

    def log_figure(self, figure, artifact_file: str) -> None:
        """A matplotlib figure as the artifact ``artifact_file``, with ``MlflowClient.log_figure`` when the server
        takes calls now; else saved beside the pending file and queued as that file (the same artifact later)."""
        if not self.is_deferred and self.flush():
            try:
                self.client.log_figure(self.run_id, figure, artifact_file)
                return
            except Exception as e:  # noqa: BLE001  (the server went away since the flush: queue the file)
                logger.warning("MLflow at %s did not take a figure (%s); queueing it", self.shown_uri, _short(e))
        where = Path(self.pending_file.parent if self.pending_file else ".") / artifact_file
        where.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(where)
        self.log_artifact(where, str(Path(artifact_file).parent) if "/" in artifact_file else None)

    def set_status(self, status: str) -> None:
        self._send("update_run", {"status": status})

    def log_datasets(self, datasets: list[dict]) -> None:
        """Dataset inputs (lineage.dataset_entry's dicts): the run page's Datasets panel."""
        self._send("log_datasets", {"datasets": datasets})

    def log_checkpoint_model(self, name: str, step: int, tags: dict[str, str], metrics: dict[str, float], **kw):
        """An evaluated checkpoint as a logged model (lineage.log_checkpoint_model): its id, or None while queued."""
        self.results.pop("log_checkpoint_model", None)
        call = {"name": name, "step": step, "tags": tags, "metrics": metrics, "timestamp": int(time.time() * 1000)}
        self._send("log_checkpoint_model", {**call, **kw})
        return self.results.get("log_checkpoint_model")

    def register_model(
        self, name: str, tags: dict[str, str], alias: str | None = None, model_name: str | None = None
    ) -> str | None:
        """A registry version of the run's logged model ``model_name``: its number, or None while it waits in the
        queue."""
        self.results.pop("register_version", None)
        self._send("register_version", {"name": name, "tags": tags, "alias": alias, "model_name": model_name})
        return self.results.get("register_version")

    def finish(self, status: str = "FINISHED") -> None:
        self._send("set_terminated", {"status": status})

    # ---- delivery ----------------------------------------------------------------------------------------

    def _send(self, method: str, kwargs: dict[str, Any]) -> None:
        self.queue.append((method, kwargs))
        if time.monotonic() >= self._next_try:
            self.flush()

    def flush(self) -> bool:
        """Send the queue in order; False (and keep the rest) at the first call the server does not take."""
        while self.queue:
            method, kwargs = self.queue[0]
            try:
                self.call(method, kwargs)
            except Exception as e:  # noqa: BLE001  (any transport or server error: keep the call, retry later)
                if getattr(e, "error_code", None) in REJECTED:
                    logger.warning("MLflow rejected a %s call, dropped it: %s", method, _short(e))
                    self.queue.pop(0)
                    continue
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    logger.warning(
                        "MLflow at %s did not take a %s call (%s); queueing and retrying every %g s",
                        self.shown_uri,
                        method,
                        _short(e),
                        self.retry_s,
                    )
                self._next_try = time.monotonic() + self.retry_s
                return False
            self.queue.pop(0)
        if self._down_since is not None:
            logger.warning("MLflow at %s is back; flushed the queued calls", self.shown_uri)
            self._down_since = None
        return True

    def call(self, method: str, kwargs: dict[str, Any]) -> None:
        """One call now (the deferred run resolved first); raises what the client raises."""
        self.run_id = resolve_run_id(self.client, self.run_id)
        if method in OPERATIONS:
            with default_tracking_uri(self.tracking_uri):
                self.results[method] = OPERATIONS[method](self.client, self.run_id, **kwargs)
        else:
            self.results[method] = getattr(self.client, method)(self.run_id, **kwargs)

    def close(self, wait_s: float = 30.0) -> bool:
        """Flush, retrying until the server has been unreachable for ``wait_s``: a blip at the end is ridden out,
        an outage already older (a server down for the whole run) is not waited for again. What is still queued
        goes to ``pending_file``."""
        while not self.flush() and time.monotonic() < self._down_since + wait_s:
            time.sleep(min(2.0, self.retry_s))
        if not self.queue:
            return True
        if self.pending_file is not None:
            self.pending_file.parent.mkdir(parents=True, exist_ok=True)
            with self.pending_file.open("a") as f:
                for method, kwargs in self.queue:
                    record = {"run_id": self.run_id, "method": method, "args": _plain(kwargs)}
                    f.write(json.dumps({**record, "tracking_uri": self.shown_uri}) + "\n")
        logger.warning(
            "MLflow at %s is unreachable: %d call(s) not sent%s",
            self.shown_uri,
            len(self.queue),
            f"; written to {self.pending_file} (`grpo tracking sync {self.pending_file.parent}` sends them later)"
            if self.pending_file
            else "",
        )
        return False


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """JSON-friendly form of a queued call (entities as dicts)."""

    def convert(v):
        if isinstance(v, list):
            return [convert(x) for x in v]
        if hasattr(v, "to_dictionary"):
            return v.to_dictionary()
        if hasattr(v, "key"):
            return {k: getattr(v, k) for k in ("key", "value", "timestamp", "step") if hasattr(v, k)}
        return v

    return {k: convert(v) for k, v in kwargs.items()}
