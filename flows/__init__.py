"""Prefect flows: the pipeline as users run and schedule it (see prefect.yaml)."""
