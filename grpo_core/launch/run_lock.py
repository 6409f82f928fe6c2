"""One run directory, one run at a time: ``grpo pipeline`` and ``grpo train`` hold a lock in
``trainer.default_local_dir`` while they run, so a manual run started while the nightly one trains cannot
interleave checkpoints, metrics and evaluations with it.

The lock is an OS file lock (``filelock``: released by the kernel when its process dies, so it cannot be left
held by a crash); beside it, ``run.holder.json`` says who holds it (host, pid, Prefect flow run, command) in
words a person can read. A holder file whose process is gone (same host, no such pid) is a stale lock:
taken over, with a warning. Re-entrant within a process (the CLI takes it, then the flow it runs).

The command is not the run's only process: killed outright, its torchrun agent and ranks go on to save the
step in flight (launch/torchrun.py). So every process of a run also holds a shared lock on
``run.members.lock``: the command takes it with ``run.lock``, torchrun's agent inherits it (``members_fd``),
each rank takes its own (``join``, named by ``$GRPO_RUN_MEMBERS``). A new command needs that lock to itself
before it goes on: while any process of the earlier run lives it refuses in one line, or waits (``--wait``).
"""

import atexit
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)
LOCK_FILE = "run.lock"
HOLDER_FILE = "run.holder.json"
MEMBERS_FILE = "run.members.lock"
MEMBERS_VAR = "GRPO_RUN_MEMBERS"  # a rank's environment: the members lock of the run it belongs to
_held: dict[Path, list] = {}  # lock file -> [FileLock, depth, members fd]: the locks this process holds
_joined: list[int] = []  # members locks a rank holds until it exits
_guard = threading.Lock()


class RunDirBusy(Exception):
    """Another live process holds the run directory."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    flow_run: str = ""
    command: str = ""
    since: str = ""

    @classmethod
    def me(cls, flow_run: str = "") -> "Holder":
        program = os.path.basename(sys.argv[0]) if sys.argv else "python"
        program = "grpo" if program in ("grpo", "__main__.py") else program  # `grpo …` or `python -m grpo_core.cli …`
        command = " ".join([program, *sys.argv[1:2]])
        return cls(socket.gethostname(), os.getpid(), flow_run, command, time.strftime("%Y-%m-%d %H:%M:%S %Z"))

    def describe(self) -> str:
        flow = f", Prefect flow run {self.flow_run}" if self.flow_run else ""
        since = f", since {self.since}" if self.since else ""
        return f"host {self.host}, pid {self.pid}{flow}{since} ({self.command or 'unknown command'})"

    def alive(self) -> bool:
        """Only answerable on its own host; elsewhere assume it is alive."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def read_holder(run_dir: str | Path) -> Holder | None:
    try:
        return Holder(**json.loads((Path(run_dir) / HOLDER_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_holder(run_dir: Path, holder: Holder) -> None:
    tmp = run_dir / f".{HOLDER_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(holder), indent=1) + "\n")
    os.replace(tmp, run_dir / HOLDER_FILE)


def acquire(run_dir: str | Path, flow_run: str = "", wait: bool = False, poll_s: float = 2.0) -> None:
    """Hold ``run_dir`` for this process, or raise RunDirBusy naming the holder (``wait``: until it is free)."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    with _guard:
        if path in _held:  # this process holds it already: one more level (the flow a CLI command runs)
            _held[path][1] += 1
            if flow_run:
                _write_holder(run_dir, Holder.me(flow_run))
            return
        lock = FileLock(str(path), timeout=0, thread_local=False)
        said = False
        while True:
            try:
                lock.acquire()
                break
            except Timeout:
                holder = read_holder(run_dir)
                who = holder.describe() if holder else "another process (no holder file)"
                if not wait:
                    raise RunDirBusy(f"run directory {run_dir} is in use by {who}; wait with --wait") from None
                if not said:
                    logger.warning("run directory %s is in use by %s; waiting for it", run_dir, who)
                    said = True
                time.sleep(poll_s)
        try:
            members = _members_to_ourselves(run_dir, wait, poll_s)
        except BaseException:
            lock.release()
            raise
        previous = read_holder(run_dir)
        if previous is not None and previous.pid != os.getpid():
            state = "its process is gone" if not previous.alive() else "it no longer holds the lock"
            logger.warning("took over run directory %s from %s: %s", run_dir, previous.describe(), state)
        _write_holder(run_dir, Holder.me(flow_run))
        _held[path] = [lock, 1, members]


def _members_to_ourselves(run_dir: Path, wait: bool, poll_s: float) -> int:
    """The members lock, once no process of an earlier run holds it, kept shared from then on (this run's
    agent and ranks share it); its descriptor. RunDirBusy while one does, unless ``wait``."""
    fd = os.open(run_dir / MEMBERS_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            previous = read_holder(run_dir)
            who = f" (started by {previous.describe()})" if previous else ""
            busy = f"run directory {run_dir} is in use by the torchrun agent or ranks of an earlier run{who}"
            if not wait:
                os.close(fd)
                raise RunDirBusy(f"{busy}, still saving their last step; wait with --wait") from None
            if not said:
                logger.warning("%s; waiting for them to end", busy)
                said = True
            time.sleep(poll_s)
    fcntl.flock(fd, fcntl.LOCK_SH)  # run.lock is ours: nobody else can take it between the two calls
    return fd


def members_fd(run_dir: str | Path) -> int | None:
    """The members lock this process holds for ``run_dir`` (to hand to the run's agent), or None."""
    entry = _held.get(Path(run_dir).resolve() / LOCK_FILE)
    return entry[2] if entry else None


def members_env(run_dir: str | Path) -> dict[str, str]:
    """What a rank needs to ``join`` the run this process holds ``run_dir`` for (nothing when it holds none)."""
    return {MEMBERS_VAR: str(Path(run_dir).resolve() / MEMBERS_FILE)} if members_fd(run_dir) is not None else {}


def join(path: str) -> None:
    """A rank's share of its run's members lock, held until the rank exits. RunDirBusy when another run has
    taken the directory over (this rank outlived its run and must not write into it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirBusy(f"{Path(path).parent}: another run has taken this run directory over") from None
    _joined.append(fd)


def release(run_dir: str | Path) -> None:
    run_dir = Path(run_dir).resolve()
    path = run_dir / LOCK_FILE
    with _guard:
        entry = _held.get(path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[path]
        (run_dir / HOLDER_FILE).unlink(missing_ok=True)
        os.close(entry[2])  # this process's share; the agent's and ranks' last until they exit
        entry[0].release()


class held:
    """``with held(run_dir, flow_run, wait):`` acquire and release around a run."""

    def __init__(self, run_dir: str | Path, flow_run: str = "", wait: bool = False):
        self.run_dir, self.flow_run, self.wait = run_dir, flow_run, wait

    def __enter__(self) -> "held":
        acquire(self.run_dir, self.flow_run, self.wait)
        return self

    def __exit__(self, *exc) -> None:
        release(self.run_dir)


def hold_until_exit(run_dir: str | Path, flow_run: str = "", wait: bool = False) -> None:
    """A command's hold (``grpo train``, ``grpo pipeline``): taken now, let go when the process ends."""
    acquire(run_dir, flow_run, wait)
    atexit.register(release, run_dir)
