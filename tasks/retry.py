"""Which failures are worth a retry: transient ones (a rank killed, a server or the hub away), not bad input,
and not a run that stopped because it was told to (SIGTERM, Ctrl-C, scancel) or ran out of its time: those
saved their last step, and the same command resumes from it when someone says so."""

from grpo_core.checkpoint.manager import CheckpointError
from grpo_core.config import ConfigError
from grpo_core.data.gsm8k import DataError
from grpo_core.launch import LaunchError
from grpo_core.models.shape import ModelShapeError
from grpo_core.rollout.hf import ModelLoadError

PERMANENT = (ConfigError, DataError, ModelShapeError, ModelLoadError, CheckpointError, ValueError)
ENDED_ON_PURPOSE = ("stopped", "timeout", "cancelled")  # LaunchError kinds (torchrun launcher, Slurm states)


def transient(task, task_run, state) -> bool:
    """Prefect's retry_condition_fn: retry unless the exception says the input is wrong."""
    error = state.result(raise_on_failure=False)
    if isinstance(error, LaunchError) and error.kind in ENDED_ON_PURPOSE:
        return False
    return not isinstance(error, PERMANENT)
