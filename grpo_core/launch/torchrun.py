"""Start the trainer under torchrun on this node (one node, or one node of many) and report how it ended.

``torchrun_argv`` is a pure function from the job shape to torchrun's command line; ``run_node`` starts it
in its own session with the config's environment, writes the agent's output (which tees every rank's
output) to ``node{R}.log``, and raises ``LaunchError`` naming the first failed rank when torchrun fails.
``launch`` joins the two for a config.

Never a hang: an overall timeout, a "stuck" guard (no new output in the node log and no touch of the
heartbeat file for ``stuck_s`` seconds) and the hang watchdog (a phase of a training step that some rank has not
finished within its limit: diagnostics/watchdog.py, reading the records the ranks write to ``phases/``) stop the job.
The stuck guard and the watchdog first have every rank write its threads' Python stacks to the node log (copied
to ``node{R}-stacks.log``, which a later launch keeps), then kill the job: ranks that make no progress would not
act on a stop request. A torchrun agent that is stopped (SIGSTOP) for a third of ``trainer.hang_timeout_s`` (of the
watchdog's floor when that is automatic) or dies (SIGKILL) ends the job too, its ranks killed at once: nothing
would collect their output or their exit, and a stopped agent would hold the run until the stuck guard.
The timeout, and SIGTERM or Ctrl-C to this process, first ask the ranks to stop: they get SIGTERM (the agent does
not: it would give them only 30 s), finish the step in flight, save it and exit; after ``stop_grace_s`` they are
killed (a second Ctrl-C kills at once). Ranks still setting up die of the SIGTERM (trainer/stop.py: nothing to save
yet), and the error says so.

Everything the job started is killed at the end, whether it succeeded or not: the agent's process group, and
every process that carries this launch's ``GRPO_LAUNCH_ID`` in its environment (torchrun starts each rank in a
session of its own, so a kill of the agent's group alone would miss them). Should this process itself be killed
outright (SIGKILL from a Prefect worker cancelling a flow run, the OOM killer), the agent gets SIGTERM once
(launch/agent.py; any other command started here gets it from the kernel, ``PR_SET_PDEATHSIG``) and stops its
ranks, which save the step in flight and keep the run directory until they end (launch/run_lock.py).

Simplification: the stuck guard watches output, not progress (the watchdog watches the phases of a step); a
trainer that is silent for longer than ``stuck_s`` (a long checkpoint save, say) should touch
``$GRPO_HEARTBEAT_FILE``.

A keyword named like a ``launch`` setting (``node_rank``, ``rdzv_id``, ``stop_grace_s``...; ``nnodes``: the
trainer's) defaults to the schema's (config/defaults.py), ``stuck_s`` to ``launch.stuck_timeout_s``'s.
"""

import contextlib
import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config.defaults import SETTING, defaults_from, schema_default
from grpo_core.config.secrets import masked_command
from grpo_core.diagnostics.watchdog import (
    DUMP_SIGNAL,
    FLOOR_S,
    PHASE_DIR_VAR,
    clear_records,
    find_hang,
    read_records,
)
from grpo_core.launch import rendezvous
from grpo_core.launch.common import (
    JobShape,
    LaunchError,
    RankFailure,
    error_line,
    first_failure,
    parse_root_causes,
    raised_line,
    tail,
)
from grpo_core.launch.processes import children, is_stopped, pids_with
from grpo_core.quiet import LOG_ONLY

log = logging.getLogger(__name__)

AGENT_MODULE = "grpo_core.launch.agent"  # torchrun, stopped once when its launcher dies (launch/agent.py)
LAUNCH_ID_VAR = "GRPO_LAUNCH_ID"
LAUNCHER_PID_VAR = "GRPO_LAUNCHER_PID"  # the agent stops once this process is gone (launch/agent.py)
HEARTBEAT_VAR = "GRPO_HEARTBEAT_FILE"
DUMPS_STACKS = ("stuck", "hang")  # guards that kill after a stack dump: a stop request would go unheard
AGENT = "agent"  # the torchrun agent stopped or died: the job is killed at once (it would answer nothing)
NO_PROGRESS = (*DUMPS_STACKS, AGENT)  # guards that end a job that saves nothing


@defaults_from("launch", "trainer")
def torchrun_argv(
    command: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int | str = SETTING,
    node_rank: int | None = SETTING,
    rdzv_endpoint: str | None = SETTING,
    rdzv_id: str = SETTING,
    rdzv_timeout_s: int = 600,
    log_dir: str | Path | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's command line for ``command`` (``[python, -m, module, args...]``, ``[python, script.py, ...]``
    or any other program, which runs with ``--no-python``).

    One node without an endpoint: the project's rendezvous (launch/rendezvous.py) on 127.0.0.1 at a free port,
    nothing listening beyond loopback. Otherwise a rendezvous at ``rdzv_endpoint`` (HOST:PORT, reachable from
    every node) that waits up to ``rdzv_timeout_s`` for all ``nnodes`` agents: the project's, listening on
    that address only, with node 0 giving it as its address to the ranks; torch's own c10d when
    ``node_rank=None`` (Slurm sets the node rank per task, and each node's address is Slurm's). With
    ``log_dir``, each rank's stdout/stderr also go to ``log_dir/<rdzv_id>_*/attempt_0/<local_rank>/``.
    torchrun itself runs on the command's interpreter, so the ranks get the same one.
    """
    if not command:
        raise ValueError("empty command")
    python, target = _split_python(command)
    argv = [python, "-m", AGENT_MODULE, f"--nnodes={nnodes}"]
    if nnodes == 1 and rdzv_endpoint is None:
        rdzv_endpoint, node_rank = f"{rendezvous.LOOPBACK}:0", 0
    elif rdzv_endpoint is None:
        raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint (HOST:PORT of the rendezvous)")
    if node_rank is not None:
        argv += [f"--node-rank={node_rank}", f"--rdzv-backend={rendezvous.BACKEND}"]
        if node_rank == 0:  # the ranks' store listens where the rendezvous does
            argv.append(f"--local-addr={rdzv_endpoint.rsplit(':', 1)[0].strip('[]')}")
    else:
        argv.append("--rdzv-backend=c10d")
    argv += [
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=join_timeout={rdzv_timeout_s}",
    ]
    argv += [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}"]
    if log_dir is not None:
        argv += [f"--log-dir={log_dir}", "--tee=3"]
    return argv + target


def _split_python(command: Sequence[str]) -> tuple[str, list[str]]:
    """(interpreter, torchrun's script part) for a command."""
    first, rest = command[0], list(command[1:])
    if not Path(first).name.startswith("python"):
        return sys.executable, ["--no-python", *command]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return first, ["-m", *rest[1:]]
    if not rest or rest[0].startswith("-"):
        raise ValueError(f"torchrun takes a script or -m module after the interpreter, not {shlex.join(command)}")
    return first, rest


@dataclass(frozen=True)
@defaults_from("launch")
class NodeLogs:
    """Where one node's launch writes: ``node{R}.log`` (agent output with every rank's lines), ``node{R}-ranks/``
    (torchrun's per-rank logs), ``node{R}-error.json`` (torchrun's error file), ``node{R}-heartbeat``,
    ``node{R}-stacks.log`` (the ranks' stacks when the job was killed for making no progress) and ``phases/``
    (every rank's phase record, shared by the nodes: diagnostics/watchdog.py)."""

    root: Path
    node_rank: int = SETTING

    @property
    def node_log(self) -> Path:
        return self.root / f"node{self.node_rank}.log"

    @property
    def rank_dir(self) -> Path:
        return self.root / f"node{self.node_rank}-ranks"

    @property
    def error_file(self) -> Path:
        return self.root / f"node{self.node_rank}-error.json"

    @property
    def heartbeat(self) -> Path:
        return self.root / f"node{self.node_rank}-heartbeat"

    @property
    def stacks(self) -> Path:
        return self.root / f"node{self.node_rank}-stacks.log"

    @property
    def phases(self) -> Path:
        return self.root / "phases"


@dataclass(frozen=True)
class NodeRun:
    """A node whose torchrun agent exited 0."""

    node_rank: int
    log_path: Path
    seconds: float


@defaults_from("launch")
def launch(
    cfg: Any,
    command: Sequence[str],
    *,
    log_dir: str | Path,
    node_rank: int = SETTING,
    rdzv_endpoint: str | None = SETTING,
    rdzv_id: str = SETTING,
    extra_env: Mapping[str, str] | None = None,
    timeout_s: float = 7 * 24 * 3600,
    stuck_s: float | None = schema_default("launch.stuck_timeout_s"),
    hang_s: float | None = schema_default("trainer.hang_timeout_s"),
    stop_grace_s: float = SETTING,
    rdzv_timeout_s: int = 600,
    pass_fds: Sequence[int] = (),
) -> NodeRun:
    """Run ``command`` on every rank of this node, shaped by ``cfg.trainer`` (``nnodes``, ``n_gpus_per_node``,
    ``env``). With ``trainer.nnodes > 1`` call this once on each node with its ``node_rank`` and the same
    ``rdzv_endpoint`` (HOST:PORT on node 0) and ``rdzv_id``. Raises ``LaunchError`` unless every rank exits 0."""
    shape = JobShape.from_config(cfg)
    logs = NodeLogs(Path(log_dir), node_rank)
    argv = torchrun_argv(
        command,
        nproc_per_node=shape.nproc_per_node,
        nnodes=shape.nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_timeout_s=rdzv_timeout_s,
        log_dir=logs.rank_dir,
    )
    single_node = shape.nnodes == 1 and rdzv_endpoint is None
    env = {**(rendezvous.loopback_env() if single_node else {}), **shape.env, **(extra_env or {})}
    return run_node(
        argv,
        logs,
        env=env,
        timeout_s=timeout_s,
        stuck_s=stuck_s,
        hang_s=hang_s,
        stop_grace_s=stop_grace_s,
        pass_fds=pass_fds,
    )


def short_command(argv: Sequence[str]) -> str:
    """What the terminal shows of a launch: the module the ranks run and how many (the whole command line, its
    secrets masked, is the first line of the node log and goes to the run's log)."""
    last_m = max((i for i, a in enumerate(argv[:-1]) if a == "-m"), default=None)  # the ranks' (the agent's first)
    module = argv[last_m + 1] if last_m is not None else Path(argv[0]).name  # never an argument: it may be a secret
    ranks = next((a.split("=", 1)[1] for a in argv if a.startswith("--nproc-per-node=")), "?")
    return f"{module} on {ranks} rank(s) of this node"


@defaults_from("launch")
def run_node(
    argv: Sequence[str],
    logs: NodeLogs,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 7 * 24 * 3600,
    stuck_s: float | None = schema_default("launch.stuck_timeout_s"),
    hang_s: float | None = schema_default("trainer.hang_timeout_s"),
    stop_grace_s: float = SETTING,
    grace_s: float = 10.0,
    poll_s: float = 0.5,
    pass_fds: Sequence[int] = (),
) -> NodeRun:
    """Run a torchrun command line with ``env`` added to this process's environment and ``pass_fds`` open in
    it (the run's members lock: launch/run_lock.py); see the module docstring (``hang_s``: how long a stopped
    agent may take to be noticed, ``trainer.hang_timeout_s``)."""
    launch_id = uuid.uuid4().hex
    logs.root.mkdir(parents=True, exist_ok=True)
    for stale in (logs.error_file, logs.heartbeat):
        stale.unlink(missing_ok=True)
    clear_records(logs.phases)  # every node's launcher starts before any rank of the job can write one
    full_env = {
        **os.environ,
        **(env or {}),
        LAUNCH_ID_VAR: launch_id,
        LAUNCHER_PID_VAR: str(os.getpid()),
        HEARTBEAT_VAR: str(logs.heartbeat),
        PHASE_DIR_VAR: str(logs.phases),
        "TORCHELASTIC_ERROR_FILE": str(logs.error_file),
    }
    masked = masked_command(argv)  # secret-looking values as *** (config/secrets.py)
    shown = shlex.join(masked)
    log.info("node %d: %s (log: %s)", logs.node_rank, shown, logs.node_log, extra={LOG_ONLY: True})
    log.info("node %d: starting %s (command line and output: %s)", logs.node_rank, short_command(masked), logs.node_log)
    start = time.monotonic()
    with open(logs.node_log, "w") as out:
        out.write(f"$ {shown}\n")
        out.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=_in_the_agent_before_exec,
            pass_fds=tuple(pass_fds),
        )
        try:
            with _stop_requests() as asked:
                stop_s = _agent_stop_s(hang_s)
                returncode, guard = _wait(proc, logs, start, timeout_s, stuck_s, stop_s, poll_s, asked)
                if guard is not None and guard[0] not in NO_PROGRESS:  # live ranks can still save their step
                    returncode = _stop_ranks(proc, stop_grace_s, _forwarded(asked))
            stacks = guard is not None and guard[0] in DUMPS_STACKS and _dump_stacks(proc, logs)
            if guard is not None and returncode is None and not stacks and guard[0] != AGENT:
                _terminate(proc, grace_s)  # (ranks that dumped their stacks are killed at once: no "stopping" line)
        finally:
            kill_launch(proc, launch_id)
    seconds = time.monotonic() - start
    if guard is not None:
        kind, why = guard
        ended = _how_they_ended(returncode, seconds, _node_failure(logs), _forwarded(asked))
        if stacks:
            ended += f"; the ranks' Python stacks are in {logs.stacks}"
        raise LaunchError(
            f"node {logs.node_rank}: {kind}: {why}; {ended} (log: {logs.node_log})",
            kind=kind,
            node_rank=logs.node_rank,
            state=signal.Signals(asked[0]).name if asked else None,
            exit_code=returncode,
            log_path=logs.node_log,
            log_tail=tail(logs.node_log),
        )
    if returncode != 0:
        raise failure_error(returncode, logs)
    return NodeRun(logs.node_rank, logs.node_log, seconds)


def _how_they_ended(returncode: int | None, seconds: float, failure: RankFailure | None, signum: int) -> str:
    """How the ranks ended after a stop request, the timeout or the stuck guard (``signum``: what they were sent)."""
    if returncode == 0:
        return f"the ranks saved their last step and stopped after {seconds:.0f} s"
    if returncode is None:
        return f"killed the job after {seconds:.0f} s"
    if failure is not None and failure.exit_code == -signum:  # the trainer takes it once set up (trainer/stop.py)
        return f"the ranks were still starting: {failure.describe()} after {seconds:.0f} s; nothing was saved"
    if failure is not None:
        return f"{failure.describe()} after {seconds:.0f} s"
    return f"the ranks exited with code {returncode} after {seconds:.0f} s"


def _node_failure(logs: NodeLogs) -> RankFailure | None:
    """The first failed rank of torchrun's report in the node log, if it wrote one."""
    text = logs.node_log.read_text(errors="replace") if logs.node_log.exists() else ""
    return first_failure(parse_root_causes(text))


def _wait(
    proc: subprocess.Popen,
    logs: NodeLogs,
    start: float,
    timeout_s: float,
    stuck_s: float | None,
    agent_stop_s: float,
    poll_s: float,
    asked: list[int],
) -> tuple[int | None, tuple[str, str] | None]:
    """(return code, None) when torchrun exits, or (None, (guard, why)) when a stop is ``asked`` or the timeout,
    the stuck guard, the hang watchdog or the agent's stop (for over ``agent_stop_s``) fires."""
    last_seen, last_change = _activity(logs), start
    stopped_since = None
    while True:
        try:
            return proc.wait(timeout=poll_s), None
        except subprocess.TimeoutExpired:
            pass
        if asked:
            return None, ("stopped", f"{signal.Signals(asked[0]).name} received")
        now = time.monotonic()
        if now - start > timeout_s:
            return None, ("timeout", f"still running after the {timeout_s:g} s limit")
        if (hang := find_hang(read_records(logs.phases), time.time())) is not None:
            return None, ("hang", hang.describe())
        stopped_since = (stopped_since or now) if is_stopped(proc.pid) else None
        if stopped_since is not None and now - stopped_since > agent_stop_s:
            why = f"torchrun's agent (pid {proc.pid}) has been stopped (SIGSTOP) for {now - stopped_since:.0f} s"
            return None, (AGENT, why)
        seen = _activity(logs)
        if seen != last_seen:
            last_seen, last_change = seen, now
        elif stuck_s is not None and now - last_change > stuck_s:
            return None, ("stuck", f"no output and no heartbeat for {stuck_s:g} s")


def _agent_stop_s(hang_s: float | None) -> float:
    """How long the agent may stay stopped: a third of ``trainer.hang_timeout_s`` (of the watchdog's floor when that
    is automatic), so the job has ended well within the limit; a shorter stop (someone looking at it) is let be."""
    return (hang_s or FLOOR_S) / 3


def _activity(logs: NodeLogs) -> tuple[int, int]:
    """(size of the node log, mtime of the heartbeat file): any change is a sign of life."""
    sizes = []
    for path, attr in ((logs.node_log, "st_size"), (logs.heartbeat, "st_mtime_ns")):
        try:
            sizes.append(getattr(path.stat(), attr))
        except OSError:
            sizes.append(-1)
    return sizes[0], sizes[1]


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded here, not after fork


def _in_the_agent_before_exec() -> None:
    """In torchrun's process, before it starts: (1) SIGTERM when this launcher dies, however it dies, so that no
    job outlives it; (2) ignore SIGUSR1 (Slurm's early warning, sent to every process of a job), which would kill
    the agent; its ranks inherit "ignore" until the trainer's handler takes it (trainer/stop.py)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


@contextlib.contextmanager
def _stop_requests() -> Iterator[list[int]]:
    """SIGTERM, SIGINT or SIGUSR1 to this process append their number to the list (a stop request); a second one
    raises KeyboardInterrupt, so ``run_node`` kills the job at once. Only the main thread can take signals."""
    asked: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return

    def ask(signum: int, frame) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)
        print(
            f"{signal.Signals(signum).name}: the ranks finish their step, save it and stop (Ctrl-C again: kill now)",
            file=sys.stderr,
            flush=True,
        )

    previous = {sig: signal.signal(sig, ask) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        yield asked
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forwarded(asked: list[int]) -> int:
    """The signal the ranks get: SIGUSR1 as asked (its name then reads the same in their logs), else SIGTERM."""
    return signal.SIGUSR1 if asked == [signal.SIGUSR1] else signal.SIGTERM


def _stop_ranks(proc: subprocess.Popen, grace_s: float, signum: int = signal.SIGTERM) -> int | None:
    """``signum`` to each rank (a child of the agent), then wait up to ``grace_s`` for torchrun to exit: its
    return code, or None if it did not."""
    for pid in children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        return None


def _dump_stacks(proc: subprocess.Popen, logs: NodeLogs, settle_s: float = 1.0, most_s: float = 10.0) -> bool:
    """Ask each rank for its threads' Python stacks (``DUMP_SIGNAL``, diagnostics/watchdog.py) and wait until the node
    log has had them (it grew, then nothing came for ``settle_s``; at most ``most_s``); copy what came to
    ``logs.stacks``. Whether it holds a stack (a rank that did not arm the dump dies of the signal instead)."""
    offset, ranks = _size(logs.node_log), children(proc.pid)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, DUMP_SIGNAL)
    if not ranks:
        return False
    begun = changed = time.monotonic()
    size = offset
    while time.monotonic() - begun < most_s and (size == offset or time.monotonic() - changed < settle_s):
        time.sleep(0.1)
        if (now := _size(logs.node_log)) != size:
            size, changed = now, time.monotonic()
    with open(logs.node_log, "rb") as node_log:
        node_log.seek(offset)
        dumped = node_log.read()
    if b"(most recent call first)" not in dumped:
        return False
    logs.stacks.write_bytes(dumped)
    return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _terminate(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the agent's group (torchrun passes it on to the ranks) and give it ``grace_s`` to exit."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def kill_launch(proc: subprocess.Popen, launch_id: str) -> None:
    """SIGKILL the agent's process group and every process whose environment carries ``launch_id``."""
    for _ in range(5):
        pids = launch_pids(launch_id)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            break
        time.sleep(0.1)
    proc.wait()


def launch_pids(launch_id: str) -> list[int]:
    """Live processes started by the launch ``launch_id`` (their environment says so; zombies have none)."""
    return pids_with(f"{LAUNCH_ID_VAR}={launch_id}")


def failure_error(returncode: int, logs: NodeLogs) -> LaunchError:
    """The ``LaunchError`` for a torchrun agent that exited with ``returncode``: the first failed rank from its
    report, with that rank's own log tail (or the node log's when the rank has none)."""
    if returncode < 0:  # the agent itself was killed (SIGKILL, the OOM killer): it reported nothing
        return LaunchError(
            f"node {logs.node_rank}: {AGENT}: torchrun's agent was killed by {_signal_name(-returncode)}; "
            f"killed its ranks (log: {logs.node_log})",
            kind=AGENT,
            node_rank=logs.node_rank,
            exit_code=returncode,
            log_path=logs.node_log,
            log_tail=tail(logs.node_log),
        )
    text = logs.node_log.read_text(errors="replace") if logs.node_log.exists() else ""
    failure = first_failure(parse_root_causes(text))
    if failure is None:
        last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
        message = f"node {logs.node_rank}: torchrun exited with code {returncode} before any rank failed: {last}"
        return LaunchError(
            message,
            kind="failed",
            node_rank=logs.node_rank,
            exit_code=returncode,
            log_path=logs.node_log,
            log_tail=tail(logs.node_log),
        )
    rank_log, rank_tail = rank_log_tail(logs.rank_dir, failure.local_rank)
    return LaunchError(
        f"node {logs.node_rank}: {failure.describe(error_line(rank_tail) or raised_line(rank_log))} "
        f"(log: {rank_log or logs.node_log})",
        kind="failed",
        failure=failure,
        node_rank=logs.node_rank,
        exit_code=failure.exit_code,
        log_path=rank_log or logs.node_log,
        log_tail=rank_tail or tail(logs.node_log),
    )


def _signal_name(number: int) -> str:
    """``SIGKILL`` for 9; a number no signal of this platform has, as such."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def rank_log_tail(rank_dir: Path, local_rank: int, lines: int = 40) -> tuple[Path | None, str]:
    """(log directory, stderr then stdout tail) of a local rank's latest attempt under torchrun's ``--log-dir``."""
    attempts = sorted(rank_dir.glob(f"*/attempt_*/{local_rank}"), key=lambda p: p.stat().st_mtime)
    if not attempts:
        return None, ""
    latest = attempts[-1]
    parts = [
        f"[{name}]\n{text}" for name in ("stderr.log", "stdout.log") if (text := tail(latest / name, lines)).strip()
    ]
    return latest, "\n".join(parts)
