"""What a pipeline run starts from: its config resolved once (dry_run.ResolvedRun), the registry's champion as the
start model when asked, and a fresh (scheduled) run's own directory; every task then reads that one version."""

from datetime import datetime
from pathlib import Path

from grpo_core.checks.dry_run import ResolvedRun, resolve_run
from grpo_core.config import ConfigError
from grpo_core.config.load import load_config
from grpo_core.pipeline.champion import Log, current_champion
from grpo_core.pipeline.report import Where


def fresh_overrides(cfg_dir: str, start: datetime) -> list[str]:
    """A fresh run (scheduled retraining) trains in its own directory, named by the flow run's scheduled
    start, so a retry of that flow run finds the same directory and resumes there."""
    return [f"trainer.default_local_dir={Path(cfg_dir) / start.strftime('%Y%m%d-%H%M%S')}"]


def resolve_pipeline_run(
    where: Where, config: str | None, overrides: list[str], champion: bool, fresh_start: datetime | None, log: Log
) -> tuple[ResolvedRun, list[str]]:
    """The run every task reads and the overrides pinned to it: the config, the registry's champion as the start
    model when asked (else the config's model), a fresh run's own directory (``fresh_start``: the flow run's
    scheduled start; None: the config's directory). Says in ``where`` what a failure report and notice name."""
    first = load_config(config, overrides)
    where.notify = (first.tracking.notify_webhook_url, first.tracking.notify_block)
    where.title = f"{first.trainer.project_name} / {first.trainer.experiment_name}"
    if champion:
        where.phase = "reading the registry's champion"
        if (uri := current_champion(first)) is not None:
            overrides.append(f"actor_rollout_ref.model.path={uri}")
            log.info("starting from the registry's champion: %s", uri)
        else:
            log.info("no champion in the registry yet: starting from %s", first.actor_rollout_ref.model.path)
    if fresh_start is not None:
        overrides += fresh_overrides(first.trainer.default_local_dir, fresh_start)
    run = resolve_run(config, overrides)
    if run.report.errors:
        raise ConfigError(run.report.errors, run.report.warnings)
    return run, run.pinned(overrides)  # every task reads the version resolved now
