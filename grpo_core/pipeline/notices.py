"""When the pipeline sends a notice (through tracking/notify.py): a scheduled run whose challenger is worse than the
champion (p below ``tracking.champion_alpha``), and a flow run that failed, each with the run's report as its body."""

from collections.abc import Mapping

from grpo_core.pipeline.report import Where
from grpo_core.tracking.notify import send_notice


def regression(summary: Mapping, alpha: float) -> str | None:
    """Why ``summary`` (a pipeline run's, as a dict) is a regression, or None: its model was compared with a
    champion version and is worse with p below ``alpha``."""
    against, uplift, p = (summary.get(k) for k in ("compared_with", "compared_uplift", "compared_p_value"))
    if not against or not against.startswith("champion") or uplift is None or p is None:
        return None
    if uplift < 0 and p < alpha:
        return f"the challenger is worse than {against}: uplift {uplift:+.4f}, p = {p:.3g} < {alpha:g}"
    return None


def regression_notice(where: Where, flow_run_name: str, summary: Mapping, report: str, alpha: float) -> None:
    """The notice of a regression (``regression``), when ``summary`` is one."""
    if why := regression(summary, alpha):
        subject = f"GRPO pipeline {where.title}: flow run {flow_run_name}: regression, {why}"
        send_notice(subject, f"{subject}\n\n{report}", *where.notify)


def failure_notice(where: Where, flow_run_name: str, report: str) -> None:
    """The notice of a failed flow run (``report``: its failure report), once the config named where to send it."""
    if where.notify:
        subject = f"GRPO pipeline {where.shown_title(flow_run_name)}: flow run {flow_run_name} failed in {where.phase}"
        send_notice(subject, f"{subject}\n\n{report}", *where.notify)
