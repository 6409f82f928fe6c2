"""Checks of how a run starts and where it writes: its directories and data files, the launcher's rendezvous and
limits, and the tracking settings (champion smoothing, notifications, retries)."""

import re
from pathlib import Path

from grpo_core.checks.report import Report
from grpo_core.config.schema import GRPOConfig


def _not_a_directory(path: str) -> Path | None:
    """The existing file at ``path`` or above it, which keeps ``path`` from being (made) a directory."""
    for where in (Path(path), *Path(path).parents):
        if where.exists():
            return None if where.is_dir() else where
    return None


MISSING_DATA = "data file {} does not exist yet (write it with `grpo prepare`)"
"""A warning for ``grpo train``; ``grpo pipeline`` leaves it out, as it writes the data itself."""


def check_paths(cfg: GRPOConfig, r: Report) -> None:
    run_dir = cfg.trainer.default_local_dir
    if (blocker := _not_a_directory(run_dir)) is not None:
        r.errors.append(
            f"trainer.default_local_dir={run_dir}: {blocker} is a file, not a directory; point it at a directory "
            "for the run's checkpoints, logs and metrics"
        )
    check_data_lists(cfg, r)
    for path in cfg.data.train_files + cfg.data.val_files:
        if path.strip() and not Path(path).exists():
            r.warnings.append(MISSING_DATA.format(path))
    mode = cfg.trainer.resume_mode
    if mode not in ("auto", "disable") and not Path(mode).exists():
        r.errors.append(f"trainer.resume_mode={mode!r}: not 'auto', 'disable' or an existing checkpoint path")


def check_data_lists(cfg: GRPOConfig, r: Report) -> None:
    """Data lists the ranks read: training data always, validation data when the run validates; no empty name
    (``data.train_files=[]`` failed in every rank, after the model was loaded)."""
    d, trainer = cfg.data, cfg.trainer
    if not d.train_files:
        r.errors.append("data.train_files=[]: no training data; name the prepared parquet file(s) (`grpo prepare`)")
    if not d.val_files and (trainer.val_before_train or trainer.test_freq > 0):
        why = "trainer.val_before_train=true" if trainer.val_before_train else f"trainer.test_freq={trainer.test_freq}"
        r.errors.append(f"data.val_files=[]: the run validates ({why}); name the validation parquet file(s)")
    for key in ("train_files", "val_files"):
        if any(not path.strip() for path in getattr(d, key)):
            r.errors.append(f"data.{key}={getattr(d, key)}: an empty file name")


ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
"""HOST:PORT, the host a name, an IPv4 address or a bracketed IPv6 address."""


def missing_rendezvous(cfg: GRPOConfig) -> str | None:
    """Why this config cannot start a multi-node torchrun job here, or None. A dry run only warns about it (a
    config file or `grpo plan` describes the cluster, not the address of its node 0); `grpo train` refuses."""
    nnodes = cfg.trainer.nnodes
    if nnodes > 1 and cfg.launch.launcher == "torchrun" and cfg.launch.rdzv_endpoint is None:
        return (
            f"trainer.nnodes={nnodes} with launch.launcher=torchrun needs launch.rdzv_endpoint=HOST:PORT (an address "
            "of node 0 that every node reaches) and launch.node_rank on each node; or use launch.launcher=slurm"
        )
    return None


def check_launch(cfg: GRPOConfig, r: Report) -> None:
    """How the ranks are started: the rendezvous address and this node's rank."""
    launch, nnodes = cfg.launch, cfg.trainer.nnodes
    endpoint = launch.rdzv_endpoint
    if endpoint is not None and not ((m := ENDPOINT.fullmatch(endpoint)) and 0 < int(m.group(2)) < 65536):
        r.errors.append(f"launch.rdzv_endpoint={endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
    if problem := missing_rendezvous(cfg):
        r.warnings.append(problem)
    if nnodes >= 1 and not 0 <= launch.node_rank < nnodes:
        r.errors.append(f"launch.node_rank={launch.node_rank} must be in [0, trainer.nnodes={nnodes})")
    for key in ("stuck_timeout_s", "timeout_s"):
        value = getattr(launch, key)
        if value is not None and value <= 0:
            r.errors.append(f"launch.{key}={value} must be > 0 (or null: no limit)")
    if launch.stop_grace_s < 0:
        r.errors.append(f"launch.stop_grace_s={launch.stop_grace_s} must be >= 0")
    if (hang := cfg.trainer.hang_timeout_s) is not None and hang <= 0:
        r.errors.append(f"trainer.hang_timeout_s={hang} must be > 0 (or null: automatic)")


def check_tracking(cfg: GRPOConfig, r: Report) -> None:
    """The champion's smoothing, the notification target, the pipeline's retries of a failed training."""
    if not 0 < cfg.tracking.champion_alpha <= 1:
        r.errors.append(f"tracking.champion_alpha={cfg.tracking.champion_alpha} must be in (0, 1]")
    from grpo_core.tracking.notify import target_problems  # (a leaf module: no import of the tracking package's)

    r.errors += target_problems(cfg.tracking.notify_webhook_url, cfg.tracking.notify_block)
    for key in ("train_retries", "train_retry_delay_s"):
        if (value := getattr(cfg.tracking, key)) < 0:
            r.errors.append(f"tracking.{key}={value} must be >= 0")
