"""Which failures are worth a retry: transient ones (a rank killed, a server or the hub away), not bad input."""

from grpo_core.config import ConfigError
from grpo_core.data.gsm8k import DataError
from grpo_core.models.shape import ModelShapeError
from grpo_core.rollout.hf import ModelLoadError
from grpo_core.trainer.checkpoint import CheckpointError

PERMANENT = (ConfigError, DataError, ModelShapeError, ModelLoadError, CheckpointError, ValueError)


def transient(task, task_run, state) -> bool:
    """Prefect's retry_condition_fn: retry unless the exception says the input is wrong."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, PERMANENT)
