"""Weights & Biases as a metric sink (``trainer.logger=[...,wandb]``), named as verl names it.

Project = ``trainer.project_name``, run name = ``trainer.experiment_name``, config = the flattened resolved
config with secret-looking values masked (as the MLflow params), metrics under the names and steps of
``metrics.jsonl``. wandb's own variables apply: ``WANDB_MODE=offline`` writes the run only locally (``wandb
sync`` uploads it later), ``WANDB_DIR`` says where its ``wandb/`` folder goes (default: the run directory,
``trainer.default_local_dir``), ``WANDB_API_KEY`` / ``WANDB_ENTITY`` as usual (``trainer.env`` passes them on).
"""

import os
from pathlib import Path
from typing import Any

from grpo_core.config.secrets import masked


class WandbRun:
    def __init__(self, project: str, name: str, run_dir: Path):
        import wandb  # optional: `pip install -e '.[wandb]'`; the launch check says so when it is missing

        directory = Path(os.environ.get("WANDB_DIR") or run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=str(directory))

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(masked(params), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()
