"""Train: the real trainer through torchrun (one node or c10d) or Slurm, cached on the pipeline key.

A retry (or a re-run after a crash) resumes from the run's last checkpoint: ``trainer.resume_mode=auto``. A crash
or a hang (diagnostics/watchdog.py) is retried ``tracking.train_retries`` times, ``tracking.train_retry_delay_s`` apart
(``train_task``); a run stopped on purpose is not (tasks/retry.py).
"""

from prefect import get_run_logger, task

from grpo_core.checkpoint.manager import CheckpointManager, check_same_data
from grpo_core.config.load import load_config
from grpo_core.data.prompts import position_data
from grpo_core.launch import LaunchError, run_training
from grpo_core.pipeline.inputs import pipeline_key
from grpo_core.pipeline.summary import training_rows
from grpo_core.quiet import LOG_ONLY
from grpo_core.tracking import METRICS_FILE
from grpo_core.tracking.follow import following, step_line
from grpo_core.tracking.mlflow_run import RUN_ID_VAR
from tasks.retry import transient


def _cache_key(context, parameters) -> str:
    return "train-" + pipeline_key(load_config(parameters["config_path"], parameters["overrides"]))


@task(cache_key_fn=_cache_key, persist_result=True, retries=1, retry_delay_seconds=30, retry_condition_fn=transient)
def train_grpo(config_path: str | None, overrides: list[str], mlflow_run_id: str) -> dict:
    """Run every rank to the end, its set-up lines and a line per step in the task's log; the last checkpoint and the
    steps trained."""
    cfg = load_config(config_path, overrides)
    log, total = get_run_logger(), cfg.trainer.total_training_steps
    latest = CheckpointManager.for_run(cfg.trainer).latest()
    if latest is not None and cfg.trainer.resume_mode == "auto":  # one line, no retry, before any rank starts
        model = cfg.actor_rollout_ref.model
        check_same_data(latest, position_data(cfg.data.train_files, model.path, model.lora.start))
    metrics = f"{cfg.trainer.default_local_dir}/{METRICS_FILE}"
    log.info("training %s steps; the ranks' log: %s/launch", total or "the epochs'", cfg.trainer.default_local_dir)
    try:
        with following(metrics, lambda row: log.info(step_line(row, total))):
            env = {RUN_ID_VAR: mlflow_run_id}
            log_dir = run_training(cfg, config_path, overrides, extra_env=env, on_status=log.info)
    except LaunchError as e:
        # the failed rank's own log tail, in the task's log (Prefect's, the run's): `grpo pipeline`'s terminal gets
        # the error's one line, which names the rank's log
        log.error(e.report(), extra={LOG_ONLY: True})
        raise
    latest = CheckpointManager.for_run(cfg.trainer).latest()
    if latest is None:
        raise RuntimeError(f"training ended without a checkpoint under {cfg.trainer.default_local_dir}")
    rows = training_rows(cfg.trainer.default_local_dir)
    return {"checkpoint": str(latest), "steps": len(rows), "log_dir": str(log_dir)}


def train_task(cfg, refresh_cache: bool = False):
    """``train_grpo`` with the config's retry policy."""
    t = cfg.tracking
    return train_grpo.with_options(
        retries=t.train_retries, retry_delay_seconds=t.train_retry_delay_s, refresh_cache=refresh_cache
    )
