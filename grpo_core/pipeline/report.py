"""The pipeline's report as text: one pure function from results to markdown, so the Prefect artifact, the MLflow
run's description (``mlflow.note.content``) and the regression notice say the same thing in the same words; and a
failed flow run's report, from how far it got (``Where``).

Nothing here talks to a server: callers pass what they know (the summary as a dict, links already made).
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from grpo_core.config.schema import GRPOConfig
from grpo_core.config.secrets import hide_url_passwords
from grpo_core.evaluation.stats import format_uplift

if TYPE_CHECKING:
    from grpo_core.pipeline.summary import PipelineSummary

REPORT_KEY = "grpo-pipeline-report"  # the Prefect artifact's key: every flow run's report is a version of it


def uplift_text(s: Mapping) -> str:
    """The uplift with its 95% interval and p, as ``format_uplift`` writes it, from a summary dict."""
    low, high = s["uplift_ci95"]
    result = {"uplift": s["accuracy_uplift"], "ci_low": low, "ci_high": high, "p_value": s["uplift_p_value"]}
    return format_uplift({**result, "n": s["questions"]})


def uplift_line(summary: "PipelineSummary | dict") -> str:
    """The summary's uplift as ``format_uplift`` writes it (the summary, or the flow's dict of it)."""
    return uplift_text(summary if isinstance(summary, dict) else asdict(summary))


def _link(text: str, url: str) -> str:
    return f"[{text}]({url})" if url.startswith(("http://", "https://")) else f"{text}: {url}" if url else text


def pipeline_report(s: Mapping, title: str, metric: str = "accuracy_strict") -> str:
    """The report of a finished pipeline run, ``s`` its summary (``asdict(PipelineSummary)``): accuracy before
    and after with the uplift's interval and p, the promotion and why, the data's digests, throughput, and links
    to the MLflow run and model version. Markdown that reads as plain text too (a notice's body)."""
    short = metric.replace("accuracy_", "")
    low, high = s["uplift_ci95"]
    fmt = s.get("format_rate") or ()
    version = s.get("model_version") or "-"
    if s.get("model_version") and s.get("promotion"):
        version = f"{version} ({s['promotion']})"
    lines = [
        f"# GRPO pipeline: {title}",
        "",
        "| | before | after | change (95% CI) |",
        "|---|---|---|---|",
        f"| accuracy (GSM8K, {short}, {s['questions']} questions) | {s['accuracy_baseline']:.4f} | "
        f"{s['accuracy']:.4f} | **{s['accuracy_uplift']:+.4f}** [{low:+.4f}, {high:+.4f}], "
        f"p = {s['uplift_p_value']:.3g} (exact McNemar) |",
    ]
    if len(fmt) == 2:
        lines.append(f"| format rate (`#### N` answers) | {fmt[0]:.4f} | {fmt[1]:.4f} | {fmt[1] - fmt[0]:+.4f} |")
    lines += [
        "",
        f"**Promotion:** {s.get('promotion_reason') or 'not registered (tracking.log_model is off)'}",
        "",
        "| | |",
        "|---|---|",
        f"| model version | {version} |",
        f"| throughput | {s['throughput']:.1f} tokens/s per GPU (mean of {s['steps']} steps, "
        f"{s['step_seconds']:.1f} s a step) |",
    ]
    for context, digest in (s.get("data_digests") or {}).items():
        lines.append(f"| {context} data digest | `{digest}` |")
    lines += [
        f"| checkpoint | `{s['checkpoint']}` |",
        f"| MLflow run | {_link(s.get('mlflow_run_id') or '-', s.get('mlflow_url') or '')} |",
    ]
    if s.get("model_version_url"):
        lines.append(f"| model version page | {_link(str(s.get('model_version')), s['model_version_url'])} |")
    if s.get("moved"):
        lines += ["", "What moved (95% intervals; p: exact McNemar for the evaluations, Welch for the reward):", ""]
        lines += [f"- {line}" for line in s["moved"]]
    return "\n".join(lines) + "\n"


def markdown_report(summary: "PipelineSummary", cfg: GRPOConfig) -> str:
    """The report a person reads first (the Prefect artifact, the MLflow run's description): ``pipeline_report``."""
    title = f"{cfg.trainer.project_name} / {cfg.trainer.experiment_name}"
    return pipeline_report(asdict(summary), title, cfg.evaluation.metric)


def skipped_report(title: str, reason: str) -> str:
    """The report of a scheduled run that trained nothing: ``reason`` says which inputs are the last run's."""
    return f"# GRPO pipeline: {title}: skipped\n\n{reason}\n"


def failure_report(title: str, phase: str, reason: str, mlflow_url: str = "") -> str:
    """The report of a flow run that failed: where (the phase, i.e. the task) and the one-line reason."""
    lines = [f"# GRPO pipeline: {title}: failed", "", f"**Failed in:** {phase}", "", f"**Reason:** {reason}"]
    if mlflow_url:
        lines += ["", f"**MLflow run:** {mlflow_url} (marked FAILED; a re-run with the same inputs continues it)"]
    return "\n".join(lines) + "\n"


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception as the one line a person reads: its message's first line, or its type when it has none."""
    text = str(error).strip().splitlines()
    return hide_url_passwords(text[0] if text else type(error).__name__)[:limit]


@dataclass
class Where:
    """How far a flow run got: the phase it is in (the task running, or the step between tasks), and what a
    failure report names."""

    phase: str = "loading the config"
    title: str = ""
    mlflow_url: str = ""
    notify: tuple[str | None, str | None] | None = None  # (webhook URL, block name) once the config is read

    def shown_title(self, flow_run_name: str) -> str:
        """The run's project and experiment, or the flow run's name before the config is read."""
        return self.title or f"flow run {flow_run_name}"

    def failure_report(self, flow_run_name: str, error: BaseException) -> str:
        """``failure_report`` of a flow run that stopped here with ``error``."""
        return failure_report(self.shown_title(flow_run_name), self.phase, one_line(error), self.mlflow_url)


def flow_run_where(flow_run_id: str, ui_url: str | None, database: str | None) -> str:
    """Where a person opens a flow run: its page on the Prefect server (``ui_url``: Prefect's ``url_for``), else
    (the ephemeral API, which stops with the process) the database that keeps it and the one command that shows
    it. ``database``: Prefect's connection URL (a SQLite file is named; another database is not shown)."""
    if ui_url:
        return ui_url
    kept = "Prefect's configured database (PREFECT_SERVER_DATABASE_CONNECTION_URL)"
    if database and database.startswith("sqlite"):
        kept = database.split(":///", 1)[-1]
    return (
        f"{flow_run_id}, kept in {kept}; to see it and its report: `prefect server start`, then "
        f"http://127.0.0.1:4200/runs/flow-run/{flow_run_id}"
    )


def prefect_flow_run_where(flow_run_id: str) -> str:
    """``flow_run_where`` from the current Prefect settings."""
    from prefect.settings import get_current_settings
    from prefect.utilities.urls import url_for

    settings = get_current_settings()
    database = settings.server.database.connection_url
    url = url_for("flow-run", obj_id=flow_run_id) if settings.api.url else None
    return flow_run_where(flow_run_id, url, database.get_secret_value() if database else None)
