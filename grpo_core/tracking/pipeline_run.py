"""The MLflow side of one pipeline: a run keyed by what it trains, its params, results, plots and model.

One MLflow run per pipeline key (the resolved config and the training data): a re-run after a crash
finds and continues the same run instead of starting a second one. The trainer logs its per-step
metrics into it (``GRPO_MLFLOW_RUN_ID``); the pipeline adds the evaluations, the uplift, the plots and the
registered model. Plain functions: the Prefect flow calls them, tests call them without Prefect.

A server that is down when the pipeline starts does not stop it: the run is *deferred* (mlflow_run.py),
every call waits in the queue, and is sent when the server answers or written to the run's pending file
for ``grpo tracking sync``.

Lineage (lineage.py): the run's inputs are its training and evaluation sets, named by their digest; the
evaluated checkpoint is a logged model (its step, its evaluation metrics against the evaluation set, the exported
files), and the registry version is made from it and carries the training set's digest.
"""

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from grpo_core.config.load import to_flat_dict, to_yaml
from grpo_core.config.schema import GRPOConfig
from grpo_core.config.secrets import hide_url_passwords
from grpo_core.data.lineage import dataset_digest, file_sha256
from grpo_core.evaluation.gsm8k import compare_evaluations, paired_outcomes, read_eval_set, read_samples
from grpo_core.evaluation.stats import format_uplift, mean_difference, paired_uplift, verdict
from grpo_core.tracking import METRICS_FILE
from grpo_core.tracking.lineage import (
    EVALUATION,
    TRAINING,
    dataset_entry,
    digest_tags,
    logged_model_name,
)
from grpo_core.tracking.mlflow_run import KEY_TAG, MlflowRun, quick_http, tracking_uri, training_experiment
from grpo_core.tracking.plots import (
    Curves,
    before_after_figure,
    close_figure,
    eval_points,
    plot_curves,
    plot_run,
    reward_and_format_figure,
)
from grpo_core.tracking.promotion import (
    BASE_MODEL,
    BASE_TAG,
    CHALLENGER,
    CHAMPION,
    Promotion,
    decide,
    eval_set_tags,
    judge_note,
)
from grpo_core.tracking.registry import ADAPTER_BASE_TAG, MODEL_DIGEST_TAG, files_digest, provenance_tags
from grpo_core.tracking.report import pipeline_report, uplift_text
from grpo_core.tracking.sync import PENDING_FILE

logger = logging.getLogger(__name__)
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


def evaluation_file(cfg: GRPOConfig) -> str:
    """The file both evaluations read: ``evaluation.data_file``, else the first validation file."""
    return cfg.evaluation.data_file or cfg.data.val_files[0]


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
    compared_with: str = ""  # what the promotion compared the model with, and the result (notify.regression)
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
NOTE_TAG = "mlflow.note.content"  # the run's description on its page


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
    summary.format_rate = format_rates(records)[:2]
    summary.data_digests = {k: d["digest"] for k, d in pipeline_datasets(cfg).items() if d is not None}
    run.log_metrics(
        {
            "val/accuracy_baseline": summary.accuracy_baseline,
            "perf/throughput_mean": summary.throughput,
            "timing/step_mean": summary.step_seconds,
            **{f"eval/base/{k}": v for k, v in base.items()},
        },
        step=steps,
    )
    of_the_checkpoint = {  # logged to the run too, linked to the logged model and the evaluation set
        "val/accuracy": summary.accuracy,
        "val/accuracy_uplift": summary.accuracy_uplift,
        "val/accuracy_uplift_ci95_low": paired["ci_low"],
        "val/accuracy_uplift_ci95_high": paired["ci_high"],
        "val/accuracy_uplift_p_value": paired["p_value"],
        **{f"eval/trained/{k}": v for k, v in trained.items()},
    }
    files = model_dir if model_dir is not None and cfg.tracking.log_model else None
    model_name, digests = log_evaluated_checkpoint(run, cfg, checkpoint, steps, of_the_checkpoint, files)
    plots_dir = Path(cfg.trainer.default_local_dir) / "plots"
    plots = plot_run(rows, plots_dir, summary.accuracy_baseline, summary.accuracy)
    reward = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    accuracy = eval_points(summary.accuracy_baseline, summary.accuracy, summary.questions, max(steps, 1))
    plots.append(plot_curves([Curves(cfg.trainer.experiment_name, reward, accuracy)], plots_dir / "curves.png"))
    for path in plots:
        run.log_artifact(path, "plots")
    log_figures(run, rows, summary)
    for name, directory in eval_dirs.items():
        run.log_artifact(directory, f"eval/{name}")
    if model_dir is not None and cfg.tracking.log_model:
        promotion = promotion_of(cfg, eval_dirs, champion_version, champion_tags or {})
        if not champion_known:
            reason = f"{promotion.reason}; the registry's champion could not be read, so nothing is promoted"
            promotion = replace(promotion, alias=CHALLENGER, reason=reason)
        lineage = {**digests, **data_tags(Path(checkpoint), eval_dirs["trained"])}
        if adapter_base is not None:
            lineage[ADAPTER_BASE_TAG] = adapter_base
        summary.model_version, promotion = register_model(
            run, cfg, model_dir, promotion, Path(checkpoint), model_name, lineage
        )
        summary.champion, summary.promotion = promotion.promoted, promotion.alias
        summary.promotion_reason = promotion.reason
        summary.compared_with = promotion.against
        summary.compared_uplift, summary.compared_p_value = promotion.uplift, promotion.p_value
        run.set_tags(promotion.tags())
        if summary.model_version and summary.model_version != "pending":
            name = cfg.tracking.registered_model_name or cfg.trainer.project_name
            summary.model_version_url = ui_url(run.shown_uri, f"#/models/{name}/versions/{summary.model_version}")
    summary.mlflow_url = run_url(run)
    run.log_metrics(headline_metrics(summary), step=steps)
    report = pipeline_report(asdict(summary), f"{cfg.trainer.project_name} / {cfg.trainer.experiment_name}", metric)
    run.set_tags({"grpo.steps": str(steps), "grpo.champion": str(summary.champion).lower(), NOTE_TAG: report})
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


def promotion_of(
    cfg: GRPOConfig, eval_dirs: dict[str, Path], champion_version: str | None, champion_tags: dict[str, str]
) -> Promotion:
    """The trained model against the champion's evaluation (the base model's while there is no champion), on the
    same questions (compare_evaluations refuses others); the reason says when they are not those the champion was
    judged on (its tags ``champion_tags``)."""
    if champion_version is not None:
        against, opponent = f"champion version {champion_version}", eval_dirs["champion"]
        if BASE_TAG in champion_tags:
            against += " (the base model)"
    else:
        against, opponent = BASE_MODEL, eval_dirs["base"]
    comparison = compare_evaluations(opponent, eval_dirs["trained"], cfg.evaluation.metric)
    t = cfg.tracking
    promotion = decide(comparison, against, t.champion_min_uplift, t.champion_alpha)
    judged = read_eval_set(eval_dirs["trained"])
    if champion_version is not None and judged and (note := judge_note(champion_tags, eval_set_tags(judged), against)):
        promotion = replace(promotion, reason=f"{note}: {promotion.reason}")
    return promotion


def data_tags(checkpoint: Path, trained_eval: Path) -> dict[str, str]:
    """Which data trained a model and which questions judged it, as its version's (and run's) tags, beside the
    datasets' digests (tracking/lineage.py): the training set's rows and how many its training drew, its start
    model's included (its ``rows_seen.json`` lists them), from its checkpoint's trainer state; the evaluation set
    (``eval_set_tags``, whose question ids are the run's ``eval/trained/eval_set.json``)."""
    from grpo_core.trainer.checkpoint import STATE_FILE

    tags = {}
    state = json.loads((checkpoint / STATE_FILE).read_text()) if (checkpoint / STATE_FILE).is_file() else {}
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
    name = cfg.tracking.registered_model_name or cfg.trainer.project_name
    if existing := registered_version(run.client, name, run.run_id):
        return existing
    provenance = {**provenance_tags(model_dir, checkpoint), **lineage}
    run.set_tags(provenance)
    version = run.register_model(name, {**promotion.tags(), **provenance}, promotion.alias, model_name)
    return version or "pending", promotion


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
    uri, name = tracking_uri(cfg), cfg.tracking.registered_model_name or cfg.trainer.project_name
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


def registered_version(client, name: str, run_id: str) -> tuple[str, Promotion] | None:
    """The version this MLflow run registered earlier, with the promotion its tags record; None if none."""
    try:
        found = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    except Exception:  # noqa: BLE001  (a server that is away: the queued registration decides later)
        return None
    if not found:
        return None
    return str(found[0].version), Promotion.from_tags(found[0].tags)


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


def uplift_line(summary: PipelineSummary | dict) -> str:
    """The summary's uplift as ``format_uplift`` writes it (the summary, or the flow's dict of it)."""
    return uplift_text(summary if isinstance(summary, dict) else asdict(summary))


def markdown_report(summary: PipelineSummary, cfg: GRPOConfig) -> str:
    """The report a person reads first (the Prefect artifact, the MLflow run's description): report.py's."""
    title = f"{cfg.trainer.project_name} / {cfg.trainer.experiment_name}"
    return pipeline_report(asdict(summary), title, cfg.evaluation.metric)
