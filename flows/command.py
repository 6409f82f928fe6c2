"""``grpo pipeline``: the Prefect flow (flows/grpo_pipeline.py) from the command line.

The library's ``grpo`` command imports nothing of flows/: this module adds its subcommand through the
``grpo_core.commands`` entry point group (pyproject.toml), which ``grpo_core.cli.build_parser`` reads.
"""

import argparse
import os
from pathlib import Path

from grpo_core.checks.launch import MISSING_DATA
from grpo_core.cli import exit_status
from grpo_core.cli.common import EXIT_FAILURE, EXIT_INVALID, UserError, config_arguments, console, err_console
from grpo_core.config import ConfigError
from grpo_core.config.secrets import hide_url_passwords, into_environment
from grpo_core.launch import run_lock
from grpo_core.quiet import attach_log, quiet_mlflow

PIPELINE_HELP = """prepare, evaluate the base model, train, evaluate the trained model, compare and register: the
Prefect flow (flows/grpo_pipeline.py), tracked in MLflow.

Where its data go:
  Prefect  the flow run, its task runs, logs and report artifact: the server PREFECT_API_URL names, else Prefect's
           ephemeral API, kept in $PREFECT_HOME/prefect.db (~/.prefect/prefect.db); see it with
           `prefect server start` and the flow run's address printed at the end. Task results: $PREFECT_HOME/storage.
  MLflow   the run (params, metrics, figures, datasets, the evaluated model) and the registry's versions and
           aliases: tracking.mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the
           working directory (artifacts beside it in ./mlruns); see it with `mlflow ui`.
  files    data.train_files' directory (the prepared data) and trainer.default_local_dir (checkpoints,
           evaluations, plots, launch/ logs).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``grpo_core.commands`` entry point: ``grpo pipeline`` and its arguments."""
    pipeline = sub.add_parser(
        "pipeline",
        help="prepare, evaluate, train, evaluate: the Prefect flow, tracked in MLflow",
        description=PIPELINE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config_arguments(pipeline)
    pipeline.add_argument("--fresh", action="store_true", help="train in a new directory instead of reusing results")
    pipeline.add_argument(
        "--start-from-champion",
        action="store_true",
        help="train from models:/NAME@champion when the registry has one (else the config's model)",
    )
    pipeline.add_argument(
        "--skip-unchanged",
        action="store_true",
        help="a scheduled run: train nothing when start version, data and config are the last scheduled run's",
    )
    pipeline.add_argument("--wait", action="store_true", help="wait while another run uses the run directory")
    pipeline.add_argument("overrides", nargs="*", metavar="key=value")
    pipeline.set_defaults(func=cmd_pipeline)


def cmd_pipeline(args: argparse.Namespace) -> int:
    """The Prefect flow in this process: Prefect's ephemeral API unless PREFECT_API_URL names a server."""
    # lazy: torch, and `grpo --help` imports this module
    from grpo_core.checks.dry_run import print_notes_and_warnings, resolve_run
    from grpo_core.preflight import prefect_api_problem

    run = resolve_run(args.config, args.overrides)
    written_here = {MISSING_DATA.format(p) for p in run.config.data.train_files + run.config.data.val_files}
    run.report.warnings = [w for w in run.report.warnings if w not in written_here]  # the flow prepares them
    if run.report.errors:
        raise ConfigError(run.report.errors, run.report.warnings)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry from offline machines
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # busy small machines
    if problem := prefect_api_problem():  # a server that is down: one line, before anything is written
        err_console.print(f"error: {problem}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILURE
    if not args.fresh:  # before anything is written or Prefect starts: a busy run directory fails in seconds
        run_lock.hold_until_exit(run.config.trainer.default_local_dir, wait=args.wait)  # (--fresh: a new one)
    log = attach_log(Path(run.config.trainer.default_local_dir) / "launch" / "pipeline.log")
    err_console.print(
        f"grpo pipeline: {run.config.trainer.project_name} / {run.config.trainer.experiment_name} in "
        f"{run.config.trainer.default_local_dir} (library messages: {log})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    print_notes_and_warnings(run.report, err_console)
    quiet_mlflow()  # its database set-up lines go to the log
    from flows.grpo_pipeline import FAILED_IN, grpo_pipeline  # lazy: prefect, once MLflow's set-up lines are quiet

    state = grpo_pipeline(
        config=args.config,
        overrides=into_environment(args.overrides, os.environ),  # Prefect keeps parameters: not trainer.env's values
        fresh=args.fresh,
        start_from_champion=args.start_from_champion,
        skip_unchanged=args.skip_unchanged,
        return_state=True,
    )
    if not state.is_completed():  # Prefect's tracebacks went to the log (quiet.py's ENGINE_LOGGERS)
        error = state.result(raise_on_failure=False)
        line = failure_line(state.name.lower(), error, FAILED_IN, log)
        err_console.print(f"error: {line}", markup=False, highlight=False, soft_wrap=True)
        return failure_status(error)
    print_summary(state.result())
    return 0


def failure_status(error: object) -> int:
    """The exit status of a flow run that failed with ``error``: 2 when the input was bad, as ``grpo train``'s."""
    if isinstance(error, ConfigError | UserError):
        return EXIT_INVALID
    return (exit_status(error) if isinstance(error, BaseException) else None) or EXIT_FAILURE


OUR_PACKAGES = ("grpo_core", "tasks", "flows")  # their exceptions' messages are written for the user
MAX_REASON = 1000


def failure_line(state: str, error: object, failed_in: str, log: Path) -> str:
    """A flow run that did not complete, in one line: the phase it failed in (its exception's note starting with
    ``failed_in``), why (one of our exceptions says it; another is named by its type too), where the log is. A URL's
    password is not shown."""
    notes = getattr(error, "__notes__", None) or []
    phase = next((f" in {note[len(failed_in) :]}" for note in notes if note.startswith(failed_in)), "")
    reason = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if isinstance(error, BaseException) and type(error).__module__.split(".")[0] not in OUR_PACKAGES:
        reason = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
    reason = hide_url_passwords(reason)
    if len(reason) > MAX_REASON:
        reason = reason[: MAX_REASON - 1] + "…"
    return f"pipeline {state}{phase}: {reason} (details in {log})"


def print_summary(summary: dict) -> None:
    """The flow's outcome: the accuracy before and after, the uplift, and where its run, checkpoint and model are
    (or why nothing was trained)."""
    # lazy: torch, and `grpo --help` imports this module
    from grpo_core.checkpoint.manager import describe_checkpoint
    from grpo_core.pipeline.report import prefect_flow_run_where, uplift_line

    if summary.get("skipped"):
        console.print(summary["reason"], markup=False, highlight=False, soft_wrap=True)
        return
    if summary.get("inputs"):  # --skip-unchanged: which of the training data, config and start model changed
        console.print(summary["inputs"], markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"accuracy {summary['accuracy_baseline']:.4f} -> {summary['accuracy']:.4f}, "
        f"uplift {uplift_line(summary)}; {summary['throughput']:.1f} tokens/s per GPU",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for line in summary.get("moved", []):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    where = [
        ("MLflow run", summary["mlflow_url"]),
        ("Prefect flow run", prefect_flow_run_where(summary["prefect_flow_run_id"])),
        ("checkpoint", describe_checkpoint(summary["checkpoint"])),  # what the run wrote, and how large
        ("model version", f"{summary['model_version'] or '-'} ({summary['promotion'] or 'not registered'})"),
    ]
    if summary["promotion_reason"]:
        where.append(("promotion", summary["promotion_reason"]))
    for name, value in where:
        console.print(f"{name}: {value}", markup=False, highlight=False, soft_wrap=True)
