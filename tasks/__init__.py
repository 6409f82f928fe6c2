"""Prefect tasks: thin wrappers over grpo_core functions that add caching, retries and persisted results.

Each task's cache key is what its result depends on; a cached result is only as good as the files it
names, so the flow calls a task with ``refresh_cache`` when those files are gone (``unless_missing``).
"""

from pathlib import Path

from tasks.evaluate import evaluate_checkpoint
from tasks.prepare import prepare_gsm8k
from tasks.train import train_grpo, train_task

__all__ = ["evaluate_checkpoint", "prepare_gsm8k", "train_grpo", "train_task", "unless_missing"]


def unless_missing(task, *outputs: str | Path):
    """``task``, told to ignore its cache when any of ``outputs`` does not exist (deleted since, or never written)."""
    return task.with_options(refresh_cache=not all(Path(p).exists() for p in outputs))
