"""What a pipeline run trains from, as keys: the pipeline key (its MLflow run and its training task's cache), the
inputs key, and a scheduled run's inputs by part, compared with the last finished scheduled run's so that a run with
nothing new to learn trains nothing (``--skip-unchanged``)."""

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_core.config.load import to_flat_dict
from grpo_core.config.schema import GRPOConfig
from grpo_core.data.lineage import dataset_digest, file_sha256
from grpo_core.tracking.mlflow_run import quick_http, tracking_uri

if TYPE_CHECKING:
    from grpo_core.checks.dry_run import ResolvedRun

NOT_IN_KEY = (
    "tracking.",
    "evaluation.",
    "launch.",
    "trainer.logger",
    "trainer.hang_timeout_s",
    "trainer.project_name",
    "trainer.experiment_name",
)


def pipeline_key(cfg: GRPOConfig, ignore: tuple[str, ...] = (), data: bool = True) -> str:
    """What the trained model depends on: the resolved config (less where results are logged, how ranks are
    started and how the model is evaluated afterwards), the training data's bytes (unless ``data`` is false) and a
    custom reward file's. A registry start model's path is its version's local copy, so the key names that version."""
    skip = NOT_IN_KEY + ignore
    settings = {k: v for k, v in to_flat_dict(cfg).items() if not k.startswith(skip)}
    parts = [json.dumps(settings, sort_keys=True, default=str)]
    inputs = [*(cfg.data.train_files if data else []), *filter(None, [cfg.custom_reward_function.path])]
    parts += [file_sha256(p) for p in inputs if Path(p).is_file()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


INPUTS_TAG = "grpo.inputs_key"
SCHEDULED_TAG = "grpo.scheduled"
# A scheduled run's inputs, one tag each, and their names in its log line (``inputs_verdict``).
INPUT_PARTS = {
    "grpo.inputs.data_digest": "the training data",
    "grpo.inputs.config": "the resolved config",
    "grpo.inputs.start_model": "the start model",
}


def inputs_key(cfg: GRPOConfig) -> str:
    """``pipeline_key`` without the run directory: a scheduled (fresh) run trains in a new directory each time,
    yet has nothing new to learn when its start model version, data and settings are the last run's."""
    return pipeline_key(cfg, ignore=("trainer.default_local_dir",))


def scheduled_inputs(cfg: GRPOConfig, start_model: str) -> dict[str, str]:
    """What a scheduled run trains from, by part (``INPUT_PARTS``): the training data's ``dataset_digest``, the
    resolved config's key (less the run directory and the start model's path) and the start model (the champion's
    version, ``models:/NAME/N``, or the config's model)."""
    ignore = ("trainer.default_local_dir", "actor_rollout_ref.model.path", "actor_rollout_ref.model.lora.adapter_path")
    data, config = dataset_digest(cfg.data.train_files), pipeline_key(cfg, ignore, data=False)
    return dict(zip(INPUT_PARTS, (data, config, start_model), strict=True))


def run_inputs(run: "ResolvedRun") -> dict[str, str]:
    """``scheduled_inputs`` of a resolved run: its start model is the registry version it resolved to, if any."""
    start = run.start_model.canonical if run.start_model else run.config.actor_rollout_ref.model.path
    return scheduled_inputs(run.config, start)


def inputs_verdict(last: tuple[str, dict[str, str]] | None, now: dict[str, str]) -> tuple[bool, str]:
    """(nothing changed, the line that says which inputs changed and which did not) of a scheduled run with inputs
    ``now`` (``scheduled_inputs``), against ``last``: the last finished scheduled run's id and tags."""
    if last is None:
        return False, "training: there is no finished scheduled run to compare with"
    run_id, tags = last
    where = f"the last scheduled run (MLflow run {run_id})"
    changed = [key for key, value in now.items() if tags.get(key) != value]
    if not changed:
        same = _listed([f"{INPUT_PARTS[key]} ({_shown(key, value)})" for key, value in now.items()])
        return True, f"nothing to train: {same} are those of {where}"
    what = [f"{INPUT_PARTS[k]} changed ({_shown(k, tags.get(k))} -> {_shown(k, now[k])})" for k in changed]
    same = [INPUT_PARTS[key] for key in now if key not in changed]
    return False, f"training: since {where}, {_listed(what)}" + (f"; {_listed(same)} did not" if same else "")


def _shown(key: str, value: str | None) -> str:
    if value is None:
        return "not recorded"
    return f"digest {value[:12]}" if key.endswith(("digest", "sha256")) else value


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def last_scheduled_run(cfg: GRPOConfig) -> tuple[str, dict[str, str]] | None:
    """(run id, tags) of the latest finished scheduled pipeline run in the experiment, or None."""
    from mlflow import MlflowClient

    quick_http()
    client = MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.trainer.project_name)
    if experiment is None:
        return None
    query = f"tags.`{SCHEDULED_TAG}` = 'true' and attributes.status = 'FINISHED'"
    newest = ["attributes.start_time DESC"]
    found = client.search_runs([experiment.experiment_id], query, order_by=newest, max_results=1)
    if not found:
        return None
    return found[0].info.run_id, found[0].data.tags


def unchanged_since(cfg: GRPOConfig, inputs: dict[str, str]) -> tuple[str | None, str]:
    """(the last finished scheduled run's id when ``inputs`` are its own, else None; ``inputs_verdict``'s line)."""
    last = last_scheduled_run(cfg)
    unchanged, line = inputs_verdict(last, inputs)
    return (last[0] if unchanged else None), line
