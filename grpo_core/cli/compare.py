"""``grpo compare``: MLflow runs side by side (config differences, accuracy, throughput), and with --plot their
reward and accuracy curves overlaid."""

import argparse
import os
import sys
from pathlib import Path

from grpo_core.cli.common import EXIT_FAILURE, UserError, console, err_console, missing_local_store
from grpo_core.tracking.compare import FORMATS, compare_runs, render, run_curves
from grpo_core.tracking.plots import plot_curves


def add_parser(sub: argparse._SubParsersAction) -> None:
    compare = sub.add_parser("compare", help="MLflow runs side by side: config differences, accuracy, throughput")
    compare.add_argument("runs", nargs="*", metavar="RUN", help="run ids (default: every run of the experiment)")
    compare.add_argument("--experiment", help="experiment name (trainer.project_name); default: all")
    compare.add_argument(
        "--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db", help="MLflow store"
    )
    compare.add_argument("--format", choices=FORMATS, default="table", help="table (80 columns when piped), or data")
    compare.add_argument("--plot", type=Path, metavar="FILE.png", help="overlay the runs' reward and accuracy curves")
    compare.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    """Runs as columns, facts and differing config keys as rows; --plot overlays their curves."""
    # lazy: mlflow, and `grpo --help` imports this module
    from mlflow.exceptions import MlflowException

    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise UserError(f"--plot writes a PNG: give a file name ending in .png, not {args.plot}")
    if problem := missing_local_store(args.tracking_uri):
        raise UserError(problem)
    try:
        comparison = compare_runs(args.tracking_uri, args.experiment, args.runs)
        curves = run_curves(args.tracking_uri, comparison) if args.plot is not None and comparison.runs else []
    except LookupError as e:
        raise UserError(str(e).strip("'\"")) from None
    except MlflowException as e:  # the server is down or refused: not the user's input
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        err_console.print(f"error: MLflow at {args.tracking_uri}: {first}", markup=False, soft_wrap=True)
        return EXIT_FAILURE
    if not comparison.runs:
        err_console.print("no runs", markup=False)
        return 0
    width = console.size.width if console.is_terminal else 80
    sys.stdout.write(render(comparison, args.format, width))
    if curves:
        try:
            plot_curves(curves, args.plot)
        except OSError as e:
            raise UserError(f"cannot write {args.plot}: {e.strerror or e}") from None
        err_console.print(f"plot: {args.plot}", markup=False, highlight=False, soft_wrap=True)
    return 0
