"""Known-harmless library chatter out of the terminal, kept in the run's log.

Megatron on a machine without Apex or Transformer Engine says so at every import, torch announces
deprecations megatron triggers, megatron's FSDP logs its set-up at INFO. None of it is actionable here;
all of it used to come before a command's own first line. ``quiet_terminal`` (called first thing by the
CLI, so before megatron is imported, in the launcher and in every rank) routes what ``NOISE`` and
``QUIET_LOGGERS`` describe away from the terminal:

- in a rank (its output is the run's log file, ``launch/node<R>.log``) the chatter is written as one line
  starting with ``MARK``; the launcher's echo (launch/run.py) leaves such lines out of the terminal;
- in the CLI process it is kept in memory until ``attach_log`` names the run's log file (``grpo train`` and
  ``grpo pipeline`` do), where it is written; a command without a run directory drops it.

Prefect's engine reports a failed task or flow run with its traceback (``ENGINE_LOGGERS``): that too goes to the log,
and to Prefect's own logs, while ``grpo pipeline`` says the failure in one line naming the log (flows/command.py).

Any other warning is shown as Python shows it. ``Tracebacks`` picks out the other lines a rank's log keeps from the
terminal: the frames of tracebacks and torchrun's own report of a failure, which the launcher says in one line.
"""

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

MARK = "[library] "
MAX_KEPT = 1000  # lines kept in memory before a log file is named (a command without one drops them)


@dataclass(frozen=True)
class Noise:
    """Warnings of ``category`` (or a subclass) raised from a file whose path contains ``path``, whose
    message matches ``message`` (a regex searched in it)."""

    category: type[Warning]
    path: str
    message: str
    why: str


NOISE = (
    Noise(
        UserWarning, "/megatron/", r"(Apex|Transformer Engine)( and Apex)? (is|are) not installed", "CPU/no-TE set-up"
    ),
    Noise(UserWarning, "/megatron/", r"(?i)deprecat", "megatron's own deprecation notices (GPTModel, layer specs)"),
    Noise(DeprecationWarning, "/megatron/", r"", "megatron's own deprecation notices (moved imports)"),
    Noise(FutureWarning, "/megatron/", r"", "megatron's own deprecation notices"),
    Noise(SyntaxWarning, "/megatron/", r"", "invalid escapes in megatron's docstrings"),
    Noise(DeprecationWarning, "/torch/", r"", "torch deprecations that megatron triggers"),
    Noise(FutureWarning, "/torch/", r"", "torch deprecations that megatron triggers"),
    Noise(
        UserWarning,
        "grpo_core/cpu_compat.py",
        r"\.grad attribute of a Tensor that is not a leaf",
        "megatron's CPU path",
    ),
    Noise(Warning, "/sqlalchemy/", r"(?i)deprecat", "MLflow's SQL store"),
)
QUIET_LOGGERS = ("megatron",)  # their INFO (set-up, buckets) is for megatron developers; WARNING and up is shown
ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
"""Where Prefect's engine reports a flow or task run; its ERROR records ("Task run failed with exception", "Finished in
state Failed", each failure with its traceback) go to the log: the command says the failure once, in one line. Prefect's
API handler on these loggers still gets every record (the flow run's logs in Prefect)."""
SAID_AGAIN = (("datasets.", "Failed to read schema from "),)
"""(logger, start of the message) of a library's error records that our own error line says again (the file, why):
the log keeps them."""
LOG_ONLY = "grpo_log_only"
"""A record with this attribute set (``extra={LOG_ONLY: True}``) goes to the log, not the terminal: a line the
terminal shows in another form (the closing summary, the short launch line), kept whole in the log and in
Prefect's task logs, which get every record."""
PROJECT = Path(__file__).resolve().parent.parent
OWN_PACKAGES = tuple(str(PROJECT / name) + "/" for name in ("grpo_core", "tasks", "flows"))
SET_UP = "set-up: "
"""The start of rank 0's status lines while it sets up (minutes on a small CPU): `grpo train` echoes them, the
pipeline's train task passes them on to its log (launch/run.py ``StatusLines``)."""
CACHED = "Finished in state Cached("  # Prefect's line for a task served from its persisted result


def is_noise(category: type[Warning], filename: str, message: str) -> bool:
    path = filename.replace("\\", "/")
    return any(issubclass(category, n.category) and n.path in path and re.search(n.message, message) for n in NOISE)


def is_quiet_record(record: logging.LogRecord) -> bool:
    """Chatter: megatron's INFO, any library's INFO (Prefect's "Finished in state Completed()", its hooks, its
    temporary server; MLflow's database set-up), Prefect's engine's reports of a failure (``ENGINE_LOGGERS``) and
    records marked ``LOG_ONLY``. Our own INFO is shown, and every other warning and error."""
    ours = record.pathname.startswith(OWN_PACKAGES)
    engine_failure = record.name.startswith(ENGINE_LOGGERS) and record.levelno >= logging.ERROR and not ours
    said_again = any(record.name.startswith(n) and str(record.msg).startswith(m) for n, m in SAID_AGAIN)
    if getattr(record, LOG_ONLY, False) or engine_failure or said_again:
        return True
    if record.levelno >= logging.WARNING:
        return False
    return record.name.startswith(QUIET_LOGGERS) or not ours


def cached_line(record: logging.LogRecord) -> str | None:
    """What the terminal says for a Prefect task served from its cache: which task, and that it did not run."""
    if record.getMessage().startswith(CACHED) and (task := getattr(record, "task_run_name", None)):
        return f"{task}: the result of an earlier run with the same inputs (not run again)"
    return None


class _Sink:
    """Where the chatter goes: marked lines on a stream (a rank), or a buffer, then a file (the CLI)."""

    def __init__(self) -> None:
        self.stream: TextIO | None = None
        self.buffer: list[str] = []
        self.file: TextIO | None = None

    def write(self, line: str) -> None:
        if self.stream is not None:  # every line of a many-line record (megatron's bucket list) marked
            self.stream.write("".join(MARK + part + "\n" for part in line.split("\n")))
            self.stream.flush()
        elif self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()
        elif len(self.buffer) < MAX_KEPT:
            self.buffer.append(line)


_sink = _Sink()
_installed = False


class _QuietFilter(logging.Filter):
    """On a terminal's handler: chatter to the sink; a cached Prefect task as one line of ours instead."""

    def __init__(self, handler: logging.Handler | None = None) -> None:
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if not is_quiet_record(record):
            return True
        _sink.write(f"{record.levelname} {record.name}: {record.getMessage()}{_traceback_of(record)}")
        if self.handler is not None and (line := cached_line(record)) is not None:
            shown = logging.makeLogRecord({**record.__dict__, "msg": line, "args": None})
            self.handler.emit(shown)
        return False


def _traceback_of(record: logging.LogRecord) -> str:
    """The traceback a record carries (``exc_info``), on the lines after its message; '' when none."""
    shown = record.exc_info and record.exc_info[0] is not None  # (exc_info=True outside an except: nothing)
    return "\n" + logging.Formatter().formatException(record.exc_info) if shown else ""


def quiet_terminal(marked: bool) -> None:
    """Install the routing for this process (idempotent), after ``logging.basicConfig``: the root logger's
    handlers get the filter. ``marked``: write the chatter to stderr as ``MARK`` lines (a rank, whose
    stderr is the log file); else keep it for ``attach_log``."""
    global _installed
    _sink.stream = sys.stderr if marked else None
    if _installed:
        return
    _installed = True
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if is_noise(category, str(filename), str(message)):
            _sink.write(f"{category.__name__}: {message} ({filename}:{lineno})")
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    for handler in logging.getLogger().handlers:  # a record of a child logger passes only handlers' filters
        handler.addFilter(_QuietFilter(handler))


def quiet_mlflow() -> None:
    """MLflow's loggers have a handler of their own and do not propagate: its INFO (database set-up) goes where
    other chatter goes. Imports mlflow (which sets its handler up then); call it before MLflow is used."""
    import mlflow  # noqa: F401

    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # its run links: our closing lines say it
    _filter_handlers_of("mlflow")


def quiet_datasets() -> None:
    """Hugging Face datasets' loggers have a handler of their own, and propagate: each record was written twice, the
    chatter too. Once now, through its handler, which routes the chatter (and ``SAID_AGAIN``) to the log. Imports
    datasets; call it before datasets is used."""
    import datasets.utils.logging

    _filter_handlers_of("datasets")
    datasets.utils.logging.disable_propagation()


def _filter_handlers_of(name: str) -> None:
    """The routing on the handlers of a library's own logger (one that does not go through the root logger's)."""
    for handler in logging.getLogger(name).handlers:
        if not any(isinstance(f, _QuietFilter) for f in handler.filters):
            handler.addFilter(_QuietFilter())


def attach_log(path: str | Path) -> Path:
    """Write what was kept so far, and what comes later, to ``path`` (appended)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sink.file = path.open("a")  # noqa: SIM115  (open for the life of the process)
    for line in _sink.buffer:
        _sink.file.write(line + "\n")
    _sink.file.flush()
    _sink.buffer.clear()
    return path


def is_marked(line: str) -> bool:
    """A line of a rank's log (``[default0]:`` or ``0: [default0]:`` prefixed, or not) that is chatter."""
    return MARK in line[:40]


_PREFIX = re.compile(r"(\d+: )?(\[default\d+\]:)?(\[rank\d+\]: )?")  # srun --label, torchrun --tee, torch's rank
_AGENT_LOG = re.compile(r"[IWE]\d{4} [\d:.]+ +\d+ \S*torch/distributed/")  # torchrun's own log records
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_DUMP = re.compile(r"((Current thread|Thread) 0x[0-9a-f]+|Stack) \(most recent call first\):")  # faulthandler's
_RULE = "=" * 20


class Tracebacks:
    """``hides(line)``, line by line through a log (a rank's, or a node's, where torchrun's agent writes between
    the ranks' prefixed lines): the frames of a Python traceback (each process's told apart by its line prefix),
    a thread's "Exception in thread" line, torchrun's log records and its ChildFailedError with the report after
    it, and faulthandler's dumps of a rank's threads (diagnostics/watchdog.py). The exception line that ends a traceback
    is shown: what went wrong, in one line; ``raised`` is the last one seen (without its line prefix)."""

    def __init__(self) -> None:
        self._state: dict[str, str] = {}  # line prefix -> "frames", "after" (the exception line), "report", "rule"
        self.raised = ""

    def hides(self, line: str) -> bool:
        prefix = _PREFIX.match(line).group(0)
        text, state = line[len(prefix) :], self._state.pop(prefix, None)
        if _DUMP.match(text) or (state == "dump" and (not text.strip() or text.startswith(" "))):
            self._state[prefix] = "dump"  # a thread's header, its frames and the blank line after them
            return True
        if text.startswith("Traceback (most recent call last)"):
            self._state[prefix] = "frames"
            return True
        if state == "frames" and text.startswith(" "):
            self._state[prefix] = "frames"
            return True
        if state == "frames":  # the exception line; torchrun's ChildFailedError is followed by its report
            if "ChildFailedError" in text:
                self._state[prefix] = "report"
                return True
            self._state[prefix], self.raised = "after", text
            return False
        if state == "report":  # up to the report's opening rule of "="
            self._state[prefix] = "rule" if text.startswith(_RULE) else "report"
            return True
        if state == "rule":  # up to and with its closing rule
            if not text.startswith(_RULE):
                self._state[prefix] = "rule"
            return True
        if state == "after" and (not text.strip() or text.startswith(_CHAINED)):
            self._state[prefix] = "after"  # a chained traceback may follow
            return True
        return text.startswith("Exception in thread ") or bool(_AGENT_LOG.match(text))
