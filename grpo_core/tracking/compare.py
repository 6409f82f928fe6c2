"""``grpo compare``: runs side by side — what differs in their configs and what they achieved."""

from dataclasses import dataclass

RESULT_COLUMNS = (
    ("val/accuracy_baseline", "base acc"),
    ("val/accuracy", "trained acc"),
    ("val/accuracy_uplift", "uplift"),
    ("perf/throughput_mean", "tok/s/GPU"),
    ("timing/step_mean", "step s"),
)
# Differ between any two runs without being a choice anyone made.
IGNORED_PARAMS = ("trainer.default_local_dir",)


@dataclass
class Comparison:
    columns: list[str]
    rows: list[list[str]]


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def compare_runs(tracking_uri: str, experiment: str | None = None, run_ids: list[str] = ()) -> Comparison:
    """Named runs, or every run of ``experiment`` (all experiments when None), newest first."""
    from mlflow import MlflowClient

    from grpo_core.tracking.mlflow_run import quick_http

    quick_http()
    client = MlflowClient(tracking_uri)
    if run_ids:
        runs = [client.get_run(run_id) for run_id in run_ids]
    else:
        if experiment is None:
            ids = [e.experiment_id for e in client.search_experiments()]
        else:
            found = client.get_experiment_by_name(experiment)
            if found is None:
                raise LookupError(f"no MLflow experiment named {experiment!r} at {tracking_uri}")
            ids = [found.experiment_id]
        runs = client.search_runs(ids, order_by=["attributes.start_time DESC"]) if ids else []
    keys = sorted({k for r in runs for k in r.data.params if k not in IGNORED_PARAMS})
    differing = [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]
    columns = ["run", "name", "status", *(label for _, label in RESULT_COLUMNS), *differing]
    rows = []
    for r in runs:
        results = [_fmt(r.data.metrics.get(key)) for key, _ in RESULT_COLUMNS]
        params = [_fmt(r.data.params.get(k)) for k in differing]
        rows.append([r.info.run_id[:8], r.info.run_name or "", r.info.status, *results, *params])
    return Comparison(columns, rows)
