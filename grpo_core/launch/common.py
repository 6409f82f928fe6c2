"""What the torchrun and Slurm launchers share: the job shape read from the config, the trainer command,
``LaunchError``, and reading torchrun's failure report ("Root Cause (first observed failure)") out of a log.

Simplification: the failed rank is read from the text torchrun prints when it gives up, not from its
error files, because those exist only when the rank's ``main`` is wrapped in torch's ``@record``; when
they do exist, their message is added.
"""

import json
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config.secrets import secrets_by_reference
from grpo_core.quiet import Tracebacks, is_marked

TRAINER_MODULE = "grpo_core.main_ppo"


class LaunchError(RuntimeError):
    """A job that did not complete. ``str(error)`` is one line naming what failed (the first failed rank and its
    exit code, or the Slurm state); ``log_tail`` holds the end of that rank's (or the job's) log."""

    def __init__(
        self,
        message: str,
        *,
        kind: str,
        failure: "RankFailure | None" = None,
        node_rank: int | None = None,
        state: str | None = None,
        exit_code: str | int | None = None,
        log_path: Path | None = None,
        log_tail: str = "",
    ):
        super().__init__(" ".join(message.split()))
        self.kind = kind  # "failed", "timeout", "stuck", "stopped" or, from Slurm, the lower-case job state
        self.failure = failure
        self.node_rank = node_rank
        self.state = state
        self.exit_code = exit_code
        self.log_path = log_path
        self.log_tail = log_tail

    @property
    def rank(self) -> int | None:
        return self.failure.rank if self.failure else None

    def amended(self, more: str) -> "LaunchError":
        """This error, ``more`` added to its line."""
        self.args = (f"{self}; {more}",)
        return self

    def report(self) -> str:
        """The one-line message followed by the log tail, for printing."""
        return f"{self}\n--- log tail ({self.log_path}) ---\n{self.log_tail}"


@dataclass(frozen=True)
class JobShape:
    """The part of the config that decides how processes are started."""

    nnodes: int
    nproc_per_node: int
    device: str
    env: dict[str, str]

    @classmethod
    def from_config(cls, cfg: Any) -> "JobShape":
        """From a ``GRPOConfig``, an OmegaConf tree or a plain dict: reads ``trainer.{nnodes, n_gpus_per_node,
        device, env}``."""
        trainer = _get(cfg, "trainer")
        env = _get(trainer, "env", {}) or {}
        return cls(
            nnodes=int(_get(trainer, "nnodes", 1)),
            nproc_per_node=int(_get(trainer, "n_gpus_per_node")),
            device=str(_get(trainer, "device", "cuda")),
            env={str(k): str(v) for k, v in dict(env).items()},
        )


def _get(obj: Any, key: str, default: Any = ...) -> Any:
    value = obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)
    if value is ...:
        raise KeyError(f"config has no {key!r}")
    return value


def trainer_command(
    config_path: str | Path | None, overrides: Sequence[str] = (), python: str = sys.executable
) -> list[str]:
    """``python -m grpo_core.main_ppo [--config FILE] key=value ...``: what every rank runs. No secret-looking
    value is on it (``ps`` shows it to everyone): each is named instead (``${oc.env:NAME}``, config/secrets.py)
    and the rank reads it from its environment, a ``trainer.env`` value from what ``JobShape.env`` exports
    (``+trainer.env.NAME=${oc.env:NAME}``), any other from ``trainer_secrets(overrides)``."""
    config = ["--config", str(config_path)] if config_path is not None else []
    return [python, "-m", TRAINER_MODULE, *config, *secrets_by_reference(overrides)[0]]


def trainer_secrets(overrides: Sequence[str]) -> dict[str, str]:
    """The environment variables that ``trainer_command``'s references read (``GRPO_<KEY>`` for a secret-looking
    setting outside ``trainer.env``; a ``trainer.env`` override's own, as ``JobShape.env`` has it too): for the
    ranks' environment, never a command line or a file."""
    return secrets_by_reference(overrides)[1]


@dataclass(frozen=True)
class RankFailure:
    """One "Root Cause" entry of torchrun's failure report."""

    rank: int
    local_rank: int
    exit_code: int
    time: str  # torchrun's "YYYY-MM-DD_HH:MM:SS", local time of the node
    error_file: str | None  # the rank's error.json, written only under torch's @record
    node_label: str = ""  # srun --label prefix of the lines it came from, if any

    def describe(self, said: str = "") -> str:
        """One line; ``said``: what the rank itself said stopped it, when its error file says nothing."""
        how = f"exited with code {self.exit_code}"
        if -self.exit_code in signal.Signals.__members__.values():
            how = f"was killed by {signal.Signals(-self.exit_code).name} (exit code {self.exit_code})"
        what = f"rank {self.rank} (local rank {self.local_rank}) {how}"
        message = error_file_message(self.error_file) or said
        return f"{what}: {message}" if message else what


_LABEL = re.compile(r"^(\d+): ?")
_FIELDS = {
    "time": re.compile(r"^\s*time\s*:\s*(\S+)"),
    "rank": re.compile(r"^\s*rank\s*:\s*(-?\d+) \(local_rank: (-?\d+)\)"),
    "exitcode": re.compile(r"^\s*exitcode\s*:\s*(-?\d+)"),
    "error_file": re.compile(r"^\s*error_file\s*:\s*(.*?)\s*$"),
}


def parse_root_causes(log_text: str) -> list[RankFailure]:
    """Every "Root Cause (first observed failure)" entry in a log (one per torchrun agent that failed).
    Lines prefixed by ``srun --label`` ("1: ...") are grouped by that prefix first, so agents' output may
    interleave."""
    streams: dict[str, list[str]] = {}
    for line in log_text.splitlines():
        m = _LABEL.match(line)
        label = m.group(1) if m else ""
        streams.setdefault(label, []).append(line[m.end() :] if m else line)
    failures = []
    for label, lines in streams.items():
        for i, line in enumerate(lines):
            if not line.startswith("Root Cause (first observed failure)"):
                continue
            found: dict[str, re.Match] = {}
            for entry in lines[i + 1 : i + 12]:
                if entry.startswith("====="):
                    break
                for name, pattern in _FIELDS.items():
                    if name not in found and (m := pattern.match(entry)):
                        found[name] = m
            if {"rank", "exitcode"} <= found.keys():
                error_file = found["error_file"].group(1) if "error_file" in found else None
                failures.append(
                    RankFailure(
                        rank=int(found["rank"].group(1)),
                        local_rank=int(found["rank"].group(2)),
                        exit_code=int(found["exitcode"].group(1)),
                        time=found["time"].group(1) if "time" in found else "",
                        error_file=None if error_file in (None, "<N/A>") else error_file,
                        node_label=label,
                    )
                )
    return failures


def first_failure(failures: Sequence[RankFailure]) -> RankFailure | None:
    """The earliest failure. torchrun stamps whole seconds, so on a tie prefer the one that does not look like
    collateral damage: exit code 1 is what a peer gets from a broken collective, SIGTERM is torchrun's own
    shutdown of the surviving ranks."""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.time, f.exit_code in (1, -signal.SIGTERM)))


def rank_lines(log_text: str, failure: RankFailure, lines: int = 40) -> str:
    """The last ``lines`` lines that the failed rank printed, from a log in which torchrun ``--tee`` prefixed
    them with ``[default<local_rank>]:`` (and ``srun --label`` with the task number)."""
    prefix = (f"{failure.node_label}: " if failure.node_label else "") + f"[default{failure.local_rank}]:"
    own = [line[len(prefix) :] for line in log_text.splitlines() if line.startswith(prefix)]
    return "\n".join(own[-lines:])


def error_line(log_text: str) -> str:
    """The last ``error: …`` line of a rank's own log, without ``error: ``: the CLI's one-line report of what
    stopped it (a full disk, a bad input); '' when it printed none."""
    lines = [line for line in log_text.splitlines() if line.startswith("error: ")]
    return lines[-1][len("error: ") :].strip() if lines else ""


def error_file_message(path: str | Path | None) -> str:
    """The exception message in a torch elastic error file (``{"message": {"message": ...}}``), or ''."""
    if not path or not Path(path).is_file():
        return ""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ""
    message = data.get("message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    return " ".join(str(message).split())


def _end_of(path: Path, lines: int) -> str:
    """About the last ``lines`` lines of a file ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 1024 * lines))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log ('' if it does not exist) without library chatter and the frames of
    tracebacks (quiet.py), which stay in the file: they would crowd out what the ranks said last."""
    tracebacks = Tracebacks()
    shown = [line for line in _end_of(path, lines).splitlines() if not (is_marked(line) or tracebacks.hides(line))]
    return "\n".join(shown[-lines:])


def raised_line(rank_log: Path | None, lines: int = 40) -> str:
    """The line that ends the last traceback near the end of a rank's stderr (``rank_log``: its directory under
    torchrun's log dir), e.g. ``RuntimeError: …``: why a rank that died of an exception it did not catch (one that
    printed no ``error:`` line) stopped; '' when there is none."""
    if rank_log is None:
        return ""
    tracebacks = Tracebacks()
    for line in _end_of(rank_log / "stderr.log", lines).splitlines():
        tracebacks.hides(line)
    return tracebacks.raised.strip()
