"""Data: dataset preparation (gsm8k: raw datasets in, verl-schema parquet out) and the typed rollout
batch (batch) that moves between the GRPO stages. Nothing is imported here, so the trainer's batch type
does not pull in the dataset libraries."""
