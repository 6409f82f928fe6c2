"""``grpo compare``: runs side by side — what they achieved (uplift with its interval and p-value, the
promotion outcome) and only the config keys that differ between them.

Runs are columns and facts are rows, so a run's values and a key's full name stay readable at 80
columns and when piped; csv and json give the raw numbers, one run per row/object.
"""

import csv
import io
import json
from dataclasses import dataclass, field

from grpo_core.tracking.plots import Curves, eval_points

FORMATS = ("table", "markdown", "csv", "json")
MIN_RUN_WIDTH = 16  # a run's column in the table: "+0.031 [−0.012," fits, the rest of the uplift wraps
# What a run achieved: (label, metric), shown in this order when a run has it.
RESULTS = (
    ("base accuracy", "val/accuracy_baseline"),
    ("trained accuracy", "val/accuracy"),
    ("uplift", "val/accuracy_uplift"),
    ("uplift 95% CI low", "val/accuracy_uplift_ci95_low"),
    ("uplift 95% CI high", "val/accuracy_uplift_ci95_high"),
    ("uplift p (McNemar)", "val/accuracy_uplift_p_value"),
    ("questions", "eval/base/num_questions"),
    ("tokens/s per GPU", "perf/throughput_mean"),
    ("step s", "timing/step_mean"),
)
PROMOTION_TAGS = ("grpo.promotion", "grpo.compared_with")  # set when the pipeline registered a version
# Differ between any two runs without being a choice anyone made.
IGNORED_PARAMS = ("trainer.default_local_dir",)


@dataclass
class RunFacts:
    run_id: str
    name: str
    status: str
    metrics: dict[str, float]
    tags: dict[str, str]
    params: dict[str, str] = field(default_factory=dict)  # only the keys that differ between the runs

    @property
    def short_id(self) -> str:
        return self.run_id[:8]

    def record(self) -> dict:
        """The raw values, for csv and json."""
        results = {label: self.metrics.get(metric) for label, metric in RESULTS}
        tags = {tag.removeprefix("grpo."): self.tags.get(tag) for tag in PROMOTION_TAGS}
        return {"run_id": self.run_id, "name": self.name, "status": self.status, **results, **tags, **self.params}


@dataclass
class Comparison:
    runs: list[RunFacts]
    differing: list[str]

    def rows(self) -> list[tuple[str, list[str]]]:
        """(label, one formatted value per run): what the table and markdown show."""
        rows = [("name", [r.name for r in self.runs]), ("status", [r.status for r in self.runs])]
        rows += [
            ("base accuracy", [_accuracy(r, "val/accuracy_baseline") for r in self.runs]),
            ("trained accuracy", [_accuracy(r, "val/accuracy") for r in self.runs]),
            ("uplift", [_uplift(r) for r in self.runs]),
            ("promotion", [_promotion(r) for r in self.runs]),
            ("tokens/s per GPU", [_number(r.metrics.get("perf/throughput_mean"), ".1f") for r in self.runs]),
            ("step s (mean)", [_number(r.metrics.get("timing/step_mean"), ".1f") for r in self.runs]),
        ]
        return rows + [(key, [r.params.get(key, "-") for r in self.runs]) for key in self.differing]


def _number(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _questions(run: RunFacts) -> int | None:
    n = run.metrics.get("eval/base/num_questions")
    return None if n is None else int(n)


def _accuracy(run: RunFacts, metric: str) -> str:
    from grpo_core.evaluation.stats import wilson_interval  # scipy: not on every `grpo` start (FORMATS)

    value, n = run.metrics.get(metric), _questions(run)
    if value is None:
        return "-"
    if not n:
        return f"{value:.3f}"
    low, high = wilson_interval(round(value * n), n)
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def _uplift(run: RunFacts) -> str:
    from grpo_core.evaluation.stats import format_uplift

    m = run.metrics
    if "val/accuracy_uplift" not in m:
        return "-"
    if "val/accuracy_uplift_p_value" not in m or _questions(run) is None:
        return f"{m['val/accuracy_uplift']:+.3f} (no interval logged)"
    return format_uplift(
        {
            "uplift": m["val/accuracy_uplift"],
            "ci_low": m["val/accuracy_uplift_ci95_low"],
            "ci_high": m["val/accuracy_uplift_ci95_high"],
            "p_value": m["val/accuracy_uplift_p_value"],
            "n": _questions(run),
        }
    )


def _promotion(run: RunFacts) -> str:
    outcome, against = (run.tags.get(tag) for tag in PROMOTION_TAGS)
    if not outcome:
        return "-"
    return f"{outcome} (vs {against})" if against else outcome


def compare_runs(tracking_uri: str, experiment: str | None = None, run_ids: list[str] = ()) -> Comparison:
    """Named runs, or every run of ``experiment`` (all experiments when None), newest first."""
    client = _client(tracking_uri)
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
    facts = [
        RunFacts(
            r.info.run_id,
            r.info.run_name or "",
            r.info.status,
            dict(r.data.metrics),
            dict(r.data.tags),
            {k: r.data.params.get(k, "-") for k in differing},
        )
        for r in runs
    ]
    return Comparison(facts, differing)


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    from grpo_core.tracking.mlflow_run import quick_http

    quick_http()
    return MlflowClient(tracking_uri)


def run_curves(tracking_uri: str, comparison: Comparison) -> list[Curves]:
    """Each run's mean reward per step and its two evaluations (with intervals), read from MLflow."""
    client = _client(tracking_uri)
    curves = []
    for run in comparison.runs:
        reward = sorted((m.step, m.value) for m in client.get_metric_history(run.run_id, "reward/mean"))
        m, n = run.metrics, _questions(run)
        accuracy = []
        if n and "val/accuracy_baseline" in m and "val/accuracy" in m:
            last = max((s for s, _ in reward), default=1)
            accuracy = eval_points(m["val/accuracy_baseline"], m["val/accuracy"], n, last)
        curves.append(Curves(f"{run.short_id} {run.name}".strip(), reward, accuracy))
    return curves


# ---- rendering ---------------------------------------------------------------------------------------------


def render(comparison: Comparison, fmt: str, width: int = 80) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    return {"table": _table, "markdown": _markdown, "csv": _csv, "json": _json}[fmt](comparison, width)


def _table(comparison: Comparison, width: int) -> str:
    """Plain tables, runs as columns, as many runs per table as fit ``width``; a value wraps within its column
    and a config key keeps its full name on one line (up to half the width)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    rows = comparison.rows()
    key_width = min(max(len(label) for label, _ in rows), width // 2)
    per_table = max(1, (width - key_width - 2) // (MIN_RUN_WIDTH + 3))
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    runs = comparison.runs
    for first in range(0, len(runs), per_table):
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=True)
        table.add_column("", overflow="fold", width=key_width)
        for run in runs[first : first + per_table]:
            table.add_column(run.short_id, overflow="fold", ratio=1)
        for label, values in rows:
            table.add_row(label, *values[first : first + per_table])
        console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


def _markdown(comparison: Comparison, width: int) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| | " + " | ".join(f"`{r.short_id}`" for r in comparison.runs) + " |"]
    lines.append("|---|" + "---|" * len(comparison.runs))
    lines += [f"| {cell(label)} | " + " | ".join(map(cell, values)) + " |" for label, values in comparison.rows()]
    return "\n".join(lines) + "\n"


def _csv(comparison: Comparison, width: int) -> str:
    records = [r.record() for r in comparison.runs]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(records[0]) if records else ["run_id"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return out.getvalue()


def _json(comparison: Comparison, width: int) -> str:
    return json.dumps([r.record() for r in comparison.runs], indent=2) + "\n"
