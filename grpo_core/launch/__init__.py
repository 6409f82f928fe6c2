"""How the trainer is started: torchrun on this node (one node, or one of many) or a Slurm batch job.

This is the only package that knows about processes. Both ``launch`` functions take the config (its
``trainer.nnodes``, ``trainer.n_gpus_per_node``, ``trainer.device``, ``trainer.env``) and the command each
rank runs (``trainer_command(...)``), and raise ``LaunchError`` when the job does not complete.
``run_training`` picks one of them from ``cfg.launch`` and runs the real trainer.
"""

from grpo_core.launch.common import JobShape, LaunchError, RankFailure, trainer_command
from grpo_core.launch.run import run_training

__all__ = ["JobShape", "LaunchError", "RankFailure", "run_training", "trainer_command"]
