"""What every ``grpo`` subcommand shares: the consoles, the exit statuses, UserError and the arguments and checks
more than one command uses."""

import argparse
from pathlib import Path

from rich.console import Console

EXIT_INVALID = 2
EXIT_FAILURE = 1  # also a missing package: the configuration is valid, this environment cannot run it
console = Console()
err_console = Console(stderr=True)


class UserError(Exception):
    """Invalid input from the user: printed as one line, exit status 2."""


def config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file (configs/*.yaml); defaults apply without one")
    parser.add_argument("--config-path", help="Hydra-style: the directory of --config-name")
    parser.add_argument(
        "--config-name", help="Hydra-style: DIR/NAME.yaml; verl's ppo_megatron_trainer / ppo_trainer mean the defaults"
    )


def missing_local_store(uri: str) -> str | None:
    """Why a read-only command finds nothing at a local MLflow store (a SQLite file or a file store that does not
    exist), else None; MLflow would create an empty one (an ``mlflow.db`` left wherever the command ran)."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
    elif uri.startswith("file:") or "://" not in uri:
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
    else:
        return None  # a server: it answers for itself
    if path.exists():
        return None
    return (
        f"no MLflow store at {uri} ({path.absolute()} does not exist): run this where the runs were made, or "
        "pass --tracking-uri (or set MLFLOW_TRACKING_URI)"
    )
