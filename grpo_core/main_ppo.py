"""``python -m grpo_core.main_ppo --config FILE [key=value ...] [--dry-run]``: verl's entry point."""

import sys

from grpo_core.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
