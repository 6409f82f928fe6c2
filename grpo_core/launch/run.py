"""Start the real trainer for this node the way ``cfg.launch`` says, and wait for it: what ``grpo train`` and
the pipeline's train task call.

``launch.launcher=torchrun`` runs torchrun here (``--standalone`` for one node; with ``trainer.nnodes > 1``
each node calls this with its ``launch.node_rank`` and the shared ``launch.rdzv_endpoint``/``rdzv_id``).
``launch.launcher=slurm`` submits the whole job once, from any node, and follows it. Logs go under
``<trainer.default_local_dir>/launch/``; ``echo`` copies the node's (or the Slurm job's) log to stderr as it
grows, so an interactive run still shows its per-step lines; library chatter the ranks marked and tracebacks
(quiet.py) stay in the log only.

Simplification: Slurm's rendezvous port is the port of ``launch.rdzv_endpoint`` when one is set (its host
is ignored: the job's first node hosts the rendezvous), else torchrun's usual 29500.
"""

import codecs
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from grpo_core.launch import run_lock, slurm, torchrun
from grpo_core.launch.common import LaunchError, trainer_command, trainer_secrets
from grpo_core.polling import polling
from grpo_core.quiet import SET_UP, Tracebacks, is_marked

SLURM_DEFAULT_PORT = 29500


def run_training(
    cfg: Any,
    config_path: str | Path | None,
    overrides: Sequence[str],
    *,
    extra_env: Mapping[str, str] | None = None,
    echo: bool = False,
    on_status: Callable[[str], None] | None = None,
) -> Path:
    """Run ``python -m grpo_core.main_ppo [--config F] overrides...`` on every rank of this node (or
    of the Slurm job) with ``trainer.env`` and ``extra_env`` set. Returns the log directory; raises
    ``LaunchError`` when the job fails, is killed, hangs (``launch.stuck_timeout_s``, ``trainer.hang_timeout_s``,
    which also bounds how long a stopped torchrun agent goes unnoticed: the error then names the newest
    checkpoint) or runs past ``launch.timeout_s``. Secret-looking overrides reach the ranks by environment.
    ``on_status``: called with each set-up line of rank 0 (what the run does before its first step) where
    ``echo`` is off."""
    launch_cfg = cfg.launch
    log_dir = Path(cfg.trainer.default_local_dir).resolve() / "launch"
    log_dir.mkdir(parents=True, exist_ok=True)
    # Absolute, so that the ranks find the file whatever directory they (or a Slurm job) start in.
    config = Path(config_path).resolve() if config_path is not None else None
    command = trainer_command(config, list(overrides))  # no secret on it: they go by environment
    secrets = trainer_secrets(overrides)
    out = sys.stderr if echo else StatusLines(on_status) if on_status is not None else None
    stuck_s = launch_cfg.stuck_timeout_s
    if launch_cfg.launcher == "slurm":
        before = set(log_dir.glob("slurm-*.log"))

        def job_log() -> Path | None:
            return next(iter(set(log_dir.glob("slurm-*.log")) - before), None)

        with _naming_the_newest_checkpoint(cfg), _echoing(out, job_log):
            slurm.launch(
                cfg,
                command,
                log_dir=log_dir,
                job_name=cfg.trainer.experiment_name,
                time_limit_min=launch_cfg.slurm_time_limit_min,
                stop_warning_s=round(launch_cfg.stop_grace_s),
                port=_port(launch_cfg.rdzv_endpoint) or SLURM_DEFAULT_PORT,
                sbatch_options=launch_cfg.slurm_options,
                extra_env=extra_env,
                secret_env=secrets,
                timeout_s=launch_cfg.timeout_s,
                stuck_s=stuck_s,
            )
        return log_dir
    multi_node = cfg.trainer.nnodes > 1
    node_rank = launch_cfg.node_rank if multi_node else 0
    run_dir = cfg.trainer.default_local_dir  # its members lock, when this process holds it: the agent inherits it
    members = run_lock.members_fd(run_dir)  # and each rank takes a share of its own (launch/run_lock.py)
    node_log = torchrun.NodeLogs(log_dir, node_rank).node_log
    node_log.unlink(missing_ok=True)  # so the echo never shows the last run's log
    with _naming_the_newest_checkpoint(cfg), _echoing(out, lambda: node_log if node_log.exists() else None):
        torchrun.launch(
            cfg,
            command,
            log_dir=log_dir,
            node_rank=node_rank,
            rdzv_endpoint=launch_cfg.rdzv_endpoint if multi_node else None,
            rdzv_id=launch_cfg.rdzv_id,
            extra_env={**(extra_env or {}), **secrets, **run_lock.members_env(run_dir)},
            timeout_s=launch_cfg.timeout_s if launch_cfg.timeout_s is not None else float("inf"),
            stuck_s=stuck_s,
            hang_s=cfg.trainer.hang_timeout_s,
            stop_grace_s=launch_cfg.stop_grace_s,
            pass_fds=() if members is None else (members,),
        )
    return log_dir


@contextmanager
def _naming_the_newest_checkpoint(cfg: Any) -> Iterator[None]:
    """A job killed for making no progress saved nothing: its error names the checkpoint that is left."""
    try:
        yield
    except LaunchError as e:
        if e.kind in torchrun.NO_PROGRESS:
            from grpo_core.checkpoint.manager import CheckpointManager  # torch: imported only here

            newest = CheckpointManager.for_run(cfg.trainer).latest()
            e.amended(f"the newest checkpoint is {newest}" if newest else "no checkpoint was saved")
        raise


def _port(endpoint: str | None) -> int | None:
    return int(endpoint.rsplit(":", 1)[1]) if endpoint else None


@contextmanager
def _echoing(out: TextIO | None, find: Callable[[], Path | None], poll_s: float = 0.2) -> Iterator[None]:
    """While the block runs, copy the file that ``find()`` returns (None until it exists) to ``out`` as it
    grows; what is left is copied when the block ends. None: nothing."""
    if out is None:
        yield
        return
    with polling(LogEcho(find, out).copy, poll_s, "launch-echo"):
        yield


class StatusLines:
    """A ``LogEcho`` output that passes rank 0's set-up lines on (without the rank prefix): the pipeline's train
    task says what the ranks do in the minutes before the first step, not only the steps."""

    def __init__(self, on_status: Callable[[str], None]) -> None:
        self.on_status = on_status

    def write(self, text: str) -> None:
        for line in text.splitlines():
            if (at := line.find(SET_UP)) >= 0:
                self.on_status(line[at:])

    def flush(self) -> None:
        pass


class LogEcho:
    """Copies whole lines of a growing file (the last one too, at the end) that are not library chatter or
    tracebacks (the launcher reports a failure in one line)."""

    def __init__(self, find: Callable[[], Path | None], out: TextIO):
        self.find, self.out = find, out
        self.path, self.offset, self.partial = None, 0, ""
        self.first_line = True
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a read may end inside a character
        self.tracebacks = Tracebacks()

    def copy(self, last: bool) -> None:
        self.path = self.path or self.find()
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            data = b""
        self.offset += len(data)
        lines = (self.partial + self.decoder.decode(data)).split("\n")
        self.partial = lines.pop()
        if self.first_line and lines:  # the launched command line (torchrun.py): the terminal said it short
            self.first_line = False
            lines = lines[1:] if lines[0].startswith("$ ") else lines
        if last and self.partial:
            lines, self.partial = [*lines, self.partial], ""
        if text := "".join(line + "\n" for line in lines if not (is_marked(line) or self.tracebacks.hides(line))):
            self.out.write(text)
            self.out.flush()
