"""Training checkpoints: their layout and trainer state (manager.py), manifest, contents check, streaming writer
and export to Hugging Face files. Below the trainer: evaluation, tracking, launch and the CLI read checkpoints
without importing the trainer."""
