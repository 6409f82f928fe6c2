"""The former path of verl's entry point: ``python -m grpo_core.trainer.main_ppo`` runs ``grpo_core.main_ppo``.

A hand-over of the process, not an import: the entry point checks and launches, which sits above the trainer."""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "grpo_core.main_ppo", *sys.argv[1:]])
