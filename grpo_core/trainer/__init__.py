"""The GRPO trainer: entry point (main_ppo) and the pre-flight dry run."""
