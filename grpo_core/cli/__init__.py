"""The ``grpo`` command: train (with --dry-run), pipeline, compare, tracking sync, plan, prepare, evaluate,
export, verify, keys.

Every failure a user can cause ends in one clear message and a non-zero exit: 2 for invalid
configuration or input, 1 for anything else; never a bare traceback.

Each subcommand is a module of this package with its arguments (``add_parser``) and its command (``cmd_*``);
``build_parser`` imports them all, so what they import at their top is what ``grpo --help`` costs: torch,
megatron, mlflow, prefect and pyarrow are imported inside the command functions. ``grpo pipeline`` belongs to the
orchestration layer above this package (flows/command.py): it is added through the ``grpo_core.commands``
entry point group, so that this package imports nothing of flows/ or tasks/.
"""

import argparse
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version

from grpo_core.cli import compare, convert_gguf, evaluate, export, keys, plan, prepare, tracking, train, verify
from grpo_core.cli.common import EXIT_FAILURE, EXIT_INVALID, UserError, err_console
from grpo_core.config import ConfigError
from grpo_core.config.load import resolve_config_file
from grpo_core.launch import run_lock
from grpo_core.quiet import quiet_terminal

COMMANDS_GROUP = "grpo_core.commands"  # entry points: add_parser(subparsers) functions of other packages


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's), from its metadata: no import of torch or megatron."""
    try:
        return version("grpo-megatron")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed: run `pip install -e .`)"


def add_installed_commands(sub: argparse._SubParsersAction) -> None:
    """The subcommands other installed packages register (``grpo pipeline``: flows/command.py); none when the
    project is not installed, and every other command still works."""
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        entry.load()(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO on megatron-core: prepare, train, evaluate")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (train, plan, prepare, export, verify, evaluate, convert_gguf):
        command.add_parser(sub)
    add_installed_commands(sub)  # listed here, after convert-gguf, as `grpo --help` always showed pipeline
    for command in (compare, tracking, keys):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call otherwise
    # Before anything imports megatron or torch: their known-harmless chatter stays out of the terminal.
    quiet_terminal(marked="TORCHELASTIC_RUN_ID" in os.environ)

    parser = build_parser()
    # Overrides may come before or after the flags, as in verl's command lines (train and pipeline take them).
    args, extra = parser.parse_known_args(argv)  # first: --version and --help answer without torch's import
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")

    try:
        if hasattr(args, "config_name"):
            args.config = resolve_config_file(args.config, args.config_path, args.config_name)
        return args.func(args)
    except ConfigError as e:
        for problem in e.problems:
            err_console.print(f"error: {problem}", markup=False, highlight=False, soft_wrap=True)
        for warning in e.warnings:
            err_console.print(f"warning: {warning}", style="yellow", markup=False, soft_wrap=True)
        err_console.print(f"{len(e.problems)} problem(s) in the configuration; nothing was started")
        return EXIT_INVALID
    except UserError as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_INVALID
    except ModuleNotFoundError as e:
        from grpo_core.diagnostics.advice import missing_module_line  # lazy: it imports torch

        if (line := missing_module_line(e.name)) is None:
            raise
        err_console.print(f"error: {line}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILURE
    except run_lock.RunDirBusy as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except Exception as e:
        if (status := exit_status(e)) is None:
            raise
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return status


# (module, exception): printed as one line with this exit status. Looked up in sys.modules, not imported: an
# exception of a module never imported cannot have been raised, and importing them all (transformers, torch)
# would cost a command that fails on its input in seconds many more.
KNOWN_FAILURES = (
    (EXIT_INVALID, "grpo_core.models.shape", "ModelShapeError"),
    (EXIT_INVALID, "grpo_core.data.gsm8k", "DataError"),
    (EXIT_INVALID, "grpo_core.rollout.hf", "ModelLoadError"),
    (EXIT_INVALID, "grpo_core.checkpoint.manager", "CheckpointError"),
    (EXIT_INVALID, "grpo_core.tracking.registry", "RegistryError"),
    (EXIT_INVALID, "grpo_core.models.adapter", "AdapterError"),
    (EXIT_INVALID, "grpo_core.records.reader", "RecordError"),  # a file read back is not of its schema
    (EXIT_FAILURE, "grpo_core.numerics", "NotFinite"),  # diverged: stopped before it trained on, or saved, NaN
    (EXIT_FAILURE, "grpo_core.checkpoint.manager", "CheckpointSaveError"),  # the environment's fault, not the input's
    (EXIT_FAILURE, "grpo_core.tracking.registry", "RegistryUnreachable"),
)


def exit_status(e: BaseException) -> int | None:
    """The exit status of a failure the user is told about in one line (KNOWN_FAILURES), else None."""
    for status, module, name in KNOWN_FAILURES:
        if (loaded := sys.modules.get(module)) is not None and isinstance(e, getattr(loaded, name)):
            return status
    return None
