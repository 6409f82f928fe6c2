"""``grpo train``: check a configuration (``--dry-run`` stops there), then train.

Without torchrun around it, this process is the launcher: it checks every input, holds the run directory and
starts this node's ranks (or a Slurm job); each rank runs this command again, under torchrun, and trains.
"""

import argparse
import os
import signal
from pathlib import Path

from grpo_core.checks.launch import missing_rendezvous
from grpo_core.cli.common import EXIT_FAILURE, UserError, config_arguments, console, err_console
from grpo_core.config import ConfigError
from grpo_core.launch import LaunchError, run_lock, run_training
from grpo_core.launch.torchrun import LAUNCH_ID_VAR
from grpo_core.models.lora_settings import LoRASettings
from grpo_core.quiet import attach_log, quiet_mlflow
from grpo_core.tracking.mlflow_run import RUN_ID_VAR


def add_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train (or check with --dry-run) a configuration")
    config_arguments(train)
    train.add_argument("--dry-run", action="store_true", help="resolve, check and estimate memory; start nothing")
    train.add_argument("--wait", action="store_true", help="wait while another run uses the run directory")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="or +key=value (verl's keys)")
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """Check the config, then train: in this process under torchrun, else start this node's ranks (or a Slurm job)."""
    # lazy: these import torch, and `grpo --help` imports this module
    from grpo_core.checkpoint.manager import CheckpointManager
    from grpo_core.checks.dry_run import print_notes_and_warnings, render_dry_run, resolve_run
    from grpo_core.diagnostics.advice import missing_dependencies
    from grpo_core.preflight import check_training_inputs

    run = resolve_run(args.config, args.overrides)
    if run.report.errors:
        raise ConfigError(run.report.errors, run.report.warnings)
    if args.dry_run:
        render_dry_run(run, console)
        console.print("dry run OK: the configuration is consistent and fits", style="green")
        return 0
    launcher = "TORCHELASTIC_RUN_ID" not in os.environ  # else: one rank, started by torchrun
    if launcher and (problem := missing_rendezvous(run.config)):
        raise UserError(problem)
    d = run.config.data
    if missing := [p for p in d.train_files + d.val_files if not Path(p).is_file()]:
        raise UserError(f"data file(s) {', '.join(missing)} do not exist; write them with `grpo prepare`")
    check_training_inputs(run.config, run.shape.vocab_size)
    mode = run.config.trainer.resume_mode
    if launcher and mode not in ("auto", "disable"):  # a damaged or foreign checkpoint: one line, no rank started
        _check_resume_point(run, CheckpointManager.for_run(run.config.trainer).resolve_resume(mode))
    if launcher or (os.environ.get("RANK") == "0" and LAUNCH_ID_VAR not in os.environ):  # once: ranks our launcher
        print_notes_and_warnings(run.report, err_console)  # started would repeat what it printed, one copy each
    if missing := missing_dependencies(run.config):
        for line in missing:
            err_console.print(f"error: {line}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILURE
    # Every input is checked: only now is the run directory made and held, one run at a time (node 0's launcher
    # holds it for the job: the other nodes of a multi-node run share the directory); each rank joins the hold.
    if launcher and run.config.launch.node_rank == 0:
        run_lock.hold_until_exit(run.config.trainer.default_local_dir, wait=args.wait)
    elif not launcher and (members := os.environ.get(run_lock.MEMBERS_VAR)):
        run_lock.join(members)
    if launcher:
        # the ranks load the checkpoint verified here (a damaged newer one is not looked at again)
        if mode == "auto" and (found := CheckpointManager.for_run(run.config.trainer).resolve_resume(mode)):
            _check_resume_point(run, found)
            args.overrides = [*args.overrides, f"trainer.resume_mode={found.resolve()}"]
        attach_log(Path(run.config.trainer.default_local_dir) / "launch" / "grpo.log")
        args.overrides = run.pinned(args.overrides)
        return _launch(run.config, args)

    # lazy: megatron; only a rank trains, the launcher never imports it
    from grpo_core.actor.parallel import shutdown_distributed
    from grpo_core.trainer.loop import train

    if "mlflow" in run.config.trainer.logger or RUN_ID_VAR in os.environ:
        quiet_mlflow()  # rank 0 tracks: MLflow's INFO is marked chatter, out of the launcher's echo

    train(run.config, run.shape)
    shutdown_distributed()
    return 0


def lora_record(cfg) -> dict | None:
    """What a checkpoint of this run records of its LoRA adapters (trainer/loop.py), None without LoRA."""
    lora = LoRASettings.from_config(cfg.actor_rollout_ref.model.lora, seed=cfg.actor_rollout_ref.actor.megatron.seed)
    return {**lora.record(), "base_model": cfg.actor_rollout_ref.model.path} if lora.enabled else None


def _check_resume_point(run, checkpoint: Path) -> None:
    """CheckpointError when a (verified) checkpoint cannot be resumed here: another model, per-rank optimizer
    shards of another TP/PP, or a data position in another training set."""
    # lazy: these import torch, and `grpo --help` imports this module
    from grpo_core.checkpoint.manager import (
        check_optimizer_layout,
        check_same_adapters,
        check_same_data,
        check_same_model,
        contents_setting,
    )
    from grpo_core.data.prompts import position_data

    actor = run.config.actor_rollout_ref.actor
    if "optimizer" in contents_setting(actor.checkpoint)[1]:
        tp, pp = actor.megatron.tensor_model_parallel_size, actor.megatron.pipeline_model_parallel_size
        check_optimizer_layout(checkpoint, tp, pp)
    check_same_model(checkpoint, run.shape)
    check_same_adapters(checkpoint, lora_record(run.config))
    model = run.config.actor_rollout_ref.model
    check_same_data(checkpoint, position_data(run.config.data.train_files, model.path, model.lora.start))


def _launch(cfg, args: argparse.Namespace) -> int:
    """Start the ranks as ``cfg.launch`` says (torchrun on this node, or a Slurm job) and show their output."""
    # lazy: torch, and `grpo --help` imports this module
    from grpo_core.checkpoint.manager import CheckpointManager, describe_checkpoint

    try:
        log_dir = run_training(cfg, args.config, args.overrides, echo=True)
    except LaunchError as e:
        stopped_cleanly = e.kind in ("stopped", "timeout") and e.exit_code == 0  # the ranks saved their last step
        # one line: the echo has shown the ranks' lines (their tracebacks, and torchrun's, stay in the log file)
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        if stopped_cleanly and (saved := CheckpointManager.for_run(cfg.trainer).latest()) is not None:
            err_console.print(f"the newest checkpoint is {saved}: the same command resumes from it", soft_wrap=True)
        return 128 + signal.Signals[e.state] if e.kind == "stopped" else 1
    err_console.print(f"training finished; launch logs in {log_dir}", markup=False, highlight=False, soft_wrap=True)
    if (saved := CheckpointManager.for_run(cfg.trainer).latest()) is not None:  # what it wrote, and how large
        err_console.print(f"checkpoint: {describe_checkpoint(saved)}", markup=False, highlight=False, soft_wrap=True)
    return 0
