"""``grpo tracking sync``: send the MLflow calls a run wrote to mlflow_pending.jsonl while the server was away."""

import argparse

from grpo_core.cli.common import EXIT_FAILURE, UserError, console, err_console
from grpo_core.tracking.sync import SyncError, sync_pending


def add_parser(sub: argparse._SubParsersAction) -> None:
    tracking = sub.add_parser("tracking", help="MLflow tracking of a run: send what an outage left pending")
    tracking_sub = tracking.add_subparsers(dest="tracking_command", required=True)
    sync = tracking_sub.add_parser(
        "sync", help="send a run's pending MLflow calls (mlflow_pending.jsonl) to the server; each is sent once"
    )
    sync.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (trainer.default_local_dir)")
    sync.add_argument("--tracking-uri", help="send to this server instead of the one each call was made for")
    sync.set_defaults(func=cmd_tracking_sync)


def cmd_tracking_sync(args: argparse.Namespace) -> int:
    """Send a run's pending MLflow calls (written while the server was away); each call is sent once."""
    try:
        result = sync_pending(args.run_dir, args.tracking_uri)
    except SyncError as e:
        raise UserError(str(e)) from None
    for line in result.dropped:
        err_console.print(f"warning: dropped {line}", markup=False, highlight=False, soft_wrap=True)
    runs = ", ".join(result.run_ids) or "-"
    sent = result.sent - len(result.dropped)
    done = result.already + result.sent
    if result.error:
        err_console.print(f"error: {result.error}", markup=False, highlight=False, soft_wrap=True)
        err_console.print(
            f"{done} of {result.total} call(s) in {result.pending_file} are on the server; run this again to send "
            "the rest",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return EXIT_FAILURE
    if result.sent == 0:
        message = f"nothing to send: the {result.total} call(s) in {result.pending_file} were sent before"
    else:
        message = f"sent {sent} call(s) from {result.pending_file} to run {runs}"
        message += f" ({result.already} sent before)" if result.already else ""
    console.print(message, markup=False, highlight=False, soft_wrap=True)
    return 0
