"""The files a run reads back, checked against their schemas (grpo_core/records) before any rank starts: the
prepare records beside its data, the rows its start model and start adapter had seen, the trainer state of the
checkpoint it resumes from. Each would otherwise fail, or be misread, in every rank. (The start adapter itself is
checked with LoRA's settings: checks/model.py.)"""

from pathlib import Path

from grpo_core.checks.report import Report
from grpo_core.config.schema import GRPOConfig
from grpo_core.records.reader import RecordError


def check_records(cfg: GRPOConfig, r: Report) -> None:
    _check_data_records(cfg, r)
    _check_rows_seen(cfg, r)
    mode = cfg.trainer.resume_mode
    if mode not in ("auto", "disable") and Path(mode).is_dir():
        from grpo_core.checkpoint.manager import CheckpointError, read_trainer_state  # lazy: torch

        try:
            read_trainer_state(Path(mode))
        except CheckpointError as e:
            r.errors.append(f"trainer.resume_mode: {e}")


def _check_data_records(cfg: GRPOConfig, r: Report) -> None:
    """The prepare record (``manifest.json``) beside each data file: what the run's lineage reads of it."""
    from grpo_core.data.lineage import read_record

    files = [Path(p).expanduser() for p in [*cfg.data.train_files, *cfg.data.val_files] if p.strip()]
    for directory in sorted({p.parent for p in files if p.is_file()}):
        try:
            read_record(directory)
        except RecordError as e:
            r.errors.append(f"data: {e}; `grpo prepare` writes it anew (or delete it)")


def _check_rows_seen(cfg: GRPOConfig, r: Report) -> None:
    """The rows the start model (and the adapter a LoRA run starts from) had seen, which order the run's data."""
    from grpo_core.data.gsm8k import DataError
    from grpo_core.data.prompts import rows_seen  # lazy: torch

    model = cfg.actor_rollout_ref.model
    starts = {"actor_rollout_ref.model.path": model.path, "actor_rollout_ref.model.lora.adapter_path": model.lora.start}
    for key, directory in starts.items():
        if directory and Path(directory).expanduser().is_dir():
            try:
                rows_seen(directory)
            except DataError as e:
                r.errors.append(f"{key}: {e}")
