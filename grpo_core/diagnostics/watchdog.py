"""The hang watchdog: each rank records the phase of the step it is in; the launcher ends a job whose phase has
run past its limit, with every rank's Python stacks in the log and one line saying where it stopped.

A rank (``PhaseRecorder``, driven by ``RunDiagnostics.phase`` around each phase the loop times: gen,
old_log_prob, ref, update, sync) rewrites its ``rank{R}.json`` in ``$GRPO_PHASE_DIR`` (the launcher's
``launch/phases/``) when it enters and when it leaves a phase: the step, the phase, a count of the phases it
has entered (the same on every rank, which all run the same phases in the same order), whether it is still
in it, since when, and its limit. No collective and no thread: a few hundred bytes written twice a phase.

The launcher (launch/torchrun.py) reads the records while it waits. ``find_hang`` takes the earliest phase
some rank is still in; once that rank has been in it past its limit, the job hangs: the ranks still in the
phase did not finish it, the others either finished it (and wait, typically in the next collective) or had
not reached it. The launcher then sends its ranks SIGUSR2, on which ``arm_stack_dumps`` has every thread's
Python stack written to the rank's stderr (the node log): faulthandler writes from its C signal handler,
without the GIL, so a rank blocked in a collective answers too. Then it kills the job as its stuck guard
does (a rank blocked in a collective would never act on SIGTERM) and reports the hang in one line.

The limit: ``trainer.hang_timeout_s``, or with null ``FIRST_STEP_S`` until a step has finished in this
launch (compiles, loads, warm-up), then ``STEP_MULTIPLE`` times the slowest step so far, at least
``FLOOR_S``.

Simplifications: a record's time is the rank's wall clock, read against the launcher's, so the nodes of a
multi-node job need synchronised clocks (NTP) and a shared run directory for each node's launcher to see
every rank's record (without one, each sees its own ranks'; a hang still ends the job). Only the timed
phases are watched: a hang in set-up, validation or a checkpoint save is left to the stuck guard
(``launch.stuck_timeout_s``), and a Slurm job has the stuck guard alone.
"""

import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

PHASE_DIR_VAR = "GRPO_PHASE_DIR"
DUMP_SIGNAL = signal.SIGUSR2  # a rank dumps its stacks on it (faulthandler), nothing else
FIRST_STEP_S = 3600.0  # automatic limit until a step has finished: compiles, loads, warm-up
FLOOR_S = 600.0
STEP_MULTIPLE = 5


def phase_limit(hang_timeout_s: float | None, slowest_step_s: float | None) -> float:
    """Seconds a phase may run: the setting, else automatic (see the module docstring)."""
    if hang_timeout_s:
        return float(hang_timeout_s)
    if slowest_step_s is None:
        return FIRST_STEP_S
    return max(FLOOR_S, STEP_MULTIPLE * slowest_step_s)


@dataclass(frozen=True)
class PhaseRecord:
    """A rank's latest phase entry or exit."""

    rank: int
    world: int
    step: int  # as logged, from 1
    phase: str
    seq: int  # phases this rank has entered in this launch, this one included
    open: bool  # still in it
    at: float  # time.time() of the entry or exit
    limit_s: float
    automatic: bool  # the limit is phase_limit's own, not trainer.hang_timeout_s


def arm_stack_dumps() -> None:
    """Under the launcher: every thread's Python stack to stderr on ``DUMP_SIGNAL``."""
    if os.environ.get(PHASE_DIR_VAR):
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)


class PhaseRecorder:
    """Writes this rank's ``PhaseRecord`` on entering and leaving each phase; does nothing without a
    directory (a rank not started by ``grpo train``'s launcher)."""

    def __init__(self, directory: str | Path | None, rank: int, world: int, hang_timeout_s: float | None):
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.world, self.setting = rank, world, hang_timeout_s
        self.step, self.seq = 0, 0
        self.slowest_step_s: float | None = None
        self._step_started = time.monotonic()

    @classmethod
    def from_env(cls, hang_timeout_s: float | None) -> "PhaseRecorder":
        """For this torchrun rank (``RANK``, ``WORLD_SIZE``), recording where the launcher says."""
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return cls(os.environ.get(PHASE_DIR_VAR), rank, world, hang_timeout_s)

    def begin_step(self, step: int) -> None:
        self.step, self._step_started = step, time.monotonic()

    def end_step(self) -> None:
        took = time.monotonic() - self._step_started
        self.slowest_step_s = max(took, self.slowest_step_s or 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Recorded on entry and on a normal exit (a phase that raises ends the rank: its record stays open)."""
        self.seq += 1
        self._write(name, True)
        yield
        self._write(name, False)

    def _write(self, name: str, open_: bool) -> None:
        if self.path is None:
            return
        record = PhaseRecord(
            self.rank,
            self.world,
            self.step,
            name,
            self.seq,
            open_,
            time.time(),
            phase_limit(self.setting, self.slowest_step_s),
            not self.setting,
        )
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(asdict(record)))
        os.replace(partial, self.path)  # the launcher never reads half a record


def read_records(directory: Path) -> list[PhaseRecord]:
    """Every rank's latest record in ``directory`` (none while it does not exist)."""
    records = []
    for path in directory.glob("rank*.json") if directory.is_dir() else ():
        with contextlib.suppress(OSError, ValueError, TypeError):
            records.append(PhaseRecord(**json.loads(path.read_text())))
    return records


def clear_records(directory: Path) -> None:
    """Remove an earlier launch's records (before any rank of this one can write)."""
    for path in directory.glob("rank*.json") if directory.is_dir() else ():
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Hang:
    """The earliest phase that some rank did not finish within its limit, and where each rank was."""

    step: int
    phase: str
    limit_s: float
    automatic: bool
    in_it: list[int]  # ranks still in the phase
    past: list[int]  # ranks that finished it
    behind: list[int]  # ranks whose latest record is of an earlier phase
    unheard: list[int]  # ranks with no record (still setting up, or on a node whose records are not seen here)

    def describe(self) -> str:
        """One line, e.g. ``the gen phase of step 3 did not finish on rank 1 within 20 s (rank 0 finished it)``."""
        limit = f"{self.limit_s:g} s"
        if self.automatic:
            limit += " (automatic; trainer.hang_timeout_s sets it)"
        where = [f"{ranks(self.past)} finished it"] if self.past else []
        where += [f"{ranks(self.behind)} had not reached it"] if self.behind else []
        where += [f"{ranks(self.unheard)} recorded no phase"] if self.unheard else []
        line = f"the {self.phase} phase of step {self.step} did not finish on {ranks(self.in_it)} within {limit}"
        return f"{line} ({'; '.join(where)})" if where else line


def find_hang(records: Iterable[PhaseRecord], now: float) -> Hang | None:
    """The hang the records show at ``now`` (time.time()), or None."""
    latest = {r.rank: r for r in records}
    opened = [r for r in latest.values() if r.open]
    if not opened:
        return None
    first = min(opened, key=lambda r: (r.seq, r.at))
    if now - first.at <= first.limit_s:
        return None
    in_it = sorted(rank for rank, r in latest.items() if r.seq == first.seq and r.open)
    past = sorted(rank for rank, r in latest.items() if r.seq > first.seq or (r.seq == first.seq and not r.open))
    behind = sorted(rank for rank, r in latest.items() if r.seq < first.seq)
    world = max(r.world for r in latest.values())
    unheard = sorted(set(range(world)) - set(latest))
    return Hang(first.step, first.phase, first.limit_s, first.automatic, in_it, past, behind, unheard)


def ranks(numbers: list[int]) -> str:
    """``rank 1``, ``ranks 0, 2`` or ``ranks 0-7, 9``: runs of consecutive ranks as ranges."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" if b > a + 1 else f"{a}, {b}" for a, b in runs)
    return f"rank {text}" if len(numbers) == 1 else f"ranks {text}"
