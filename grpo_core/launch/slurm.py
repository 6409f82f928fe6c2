"""Run the trainer as a Slurm batch job: one torchrun agent per node (``srun``), c10d rendezvous on the first
node of the allocation, then follow the job until it ends.

``sbatch_script`` is a pure function from the job shape to the script text. ``submit`` runs ``sbatch
--parsable``; ``follow`` polls ``scontrol show job`` (accounting, hence ``sacct``, may be disabled; it is
only the fallback once the controller has forgotten the job) and raises ``LaunchError`` with the state,
the exit code, the first failed rank that torchrun reported and the job log's tail for every end but
COMPLETED. ``launch`` does all three for a config.

Assumptions: the job log, the log directory and the interpreter of the command are on a file system every
node and this process share, and the first node's ``NodeAddr`` is reachable from the others. ``trainer.env``
and the other secret-looking values (``secret_env``: what the trainer's command line names instead of giving,
launch/common.py) reach the job through sbatch's environment (its default ``--export=ALL``), not the script: the
script is a file in the run directory, and those values are secrets (config/secrets.py); it checks that each
arrived.
"""

import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.launch.common import JobShape, LaunchError, first_failure, parse_root_causes, rank_lines, tail
from grpo_core.launch.torchrun import torchrun_argv

log = logging.getLogger(__name__)

FAILED_STATES = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE")
DONE_STATES = ("COMPLETED", *FAILED_STATES)

# Words of the torchrun command line that this batch shell expands (they hold no spaces, so stay unquoted).
_NNODES, _ENDPOINT_HOST, _RDZV_ID = "$SLURM_NNODES", "$head_addr", "$SLURM_JOB_ID"


def sbatch_script(
    command: Sequence[str],
    shape: JobShape,
    *,
    log_path: str | Path,
    job_name: str = "grpo",
    time_limit_min: int = 60,
    stop_warning_s: int | None = None,
    port: int = 29500,
    rank_log_dir: str | Path | None = None,
    rdzv_timeout_s: int = 600,
    sbatch_options: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    secret_env: Mapping[str, str] | None = None,
    workdir: str | Path | None = None,
) -> str:
    """The batch script: ``shape.nnodes`` nodes with one task each (and ``shape.nproc_per_node`` GPUs each on
    cuda), ``extra_env`` exported, the config's environment (``shape.env``) and ``secret_env``, which ``submit``
    passes to sbatch, checked by name (never written), and ``srun`` starting torchrun on every node.
    ``stop_warning_s``: Slurm sends SIGUSR1 that long before the time limit, and the ranks finish their step,
    save it and stop (trainer/stop.py). ``sbatch_options`` are further ``#SBATCH`` options, e.g.
    ``["--partition=gpu", "--exclusive"]``."""
    argv = torchrun_argv(
        command,
        nproc_per_node=shape.nproc_per_node,
        nnodes=_NNODES,
        node_rank=None,
        rdzv_endpoint=f"{_ENDPOINT_HOST}:{port}",
        rdzv_id=_RDZV_ID,
        rdzv_timeout_s=rdzv_timeout_s,
        log_dir=rank_log_dir,
    )
    python, torchrun_args = argv[0], argv[3:]  # argv = [python, -m, the agent's module, *torchrun_args]
    expanded = {f"--nnodes={_NNODES}", f"--rdzv-endpoint={_ENDPOINT_HOST}:{port}", f"--rdzv-id={_RDZV_ID}"}
    words = [w if w in expanded else shlex.quote(w) for w in torchrun_args]

    options = [
        f"--job-name={job_name}",
        f"--nodes={shape.nnodes}",
        "--ntasks-per-node=1",
        f"--time={time_limit_min}",
        f"--output={log_path}",
    ]
    if stop_warning_s and stop_warning_s < time_limit_min * 60 / 2:  # else the warning would come at the start
        options.append(f"--signal=USR1@{stop_warning_s}")
    if shape.device == "cuda":
        options.append(f"--gpus-per-node={shape.nproc_per_node}")
    if workdir is not None:
        options.append(f"--chdir={workdir}")
    options += sbatch_options
    secret = {**shape.env, **(secret_env or {})}
    env = {**secret, **(extra_env or {})}
    for key in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"not an environment variable name: {key!r}")

    lines = ["#!/bin/bash", *(f"#SBATCH {shlex.quote(o)}" for o in options), "set -euo pipefail", ""]
    extra = extra_env or {}
    lines += [f"export {key}={shlex.quote(value)}" for key, value in extra.items()]
    lines += [f': "${{{key}?not passed on by sbatch ({_setting(key, shape)})}}"' for key in secret if key not in extra]
    lines += [
        "",
        "# Rendezvous on the first node of the allocation, at the address Slurm itself reaches it by.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "head_addr=$(scontrol show node \"$head\" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)",
        f'echo "job $SLURM_JOB_ID: $SLURM_NNODES node(s), rendezvous at $head ($head_addr:{port})"',
        "",
        "# One torchrun agent per node. --node-rank is expanded by each task's shell (srun sets SLURM_NODEID",
        "# per task), not by this one; the rest of the command line is passed on as arguments. The agent ignores",
        "# SIGUSR1 (sbatch --signal=USR1@SECONDS warns every process of the job): the ranks save and stop on it.",
        "srun --label --kill-on-bad-exit=1 \\",
        '  bash -c \'trap "" USR1; exec "$0" -m torch.distributed.run --node-rank="$SLURM_NODEID" "$@"\' \\',
        f"  {shlex.quote(python)} \\",
        "  " + " ".join(words),
        "",
    ]
    return "\n".join(lines)


def submit(script_path: str | Path, env: Mapping[str, str] | None = None) -> str:
    """``sbatch --parsable SCRIPT`` with ``env`` added to its environment (which the job inherits) -> the job id."""
    out = _run(["sbatch", "--parsable", str(script_path)], env)
    return out.strip().split(";")[0]  # "ID" or "ID;cluster"


def cancel(job_id: str) -> None:
    _run(["scancel", job_id])


@dataclass(frozen=True)
class JobStatus:
    state: str  # PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, ...
    exit_code: str  # "exit:signal", as Slurm prints it, e.g. "1:0" or "0:15"


def parse_scontrol_job(text: str) -> JobStatus | None:
    """JobState and ExitCode (not DerivedExitCode) from ``scontrol show job`` output."""
    state = re.search(r"\bJobState=(\S+)", text)
    code = re.search(r"\bExitCode=(\S+)", text)
    if not state:
        return None
    return JobStatus(state.group(1), code.group(1) if code else "")


def job_status(job_id: str) -> JobStatus | None:
    """The job's state from the controller, or, once it has forgotten the job (MinJobAge after the end), from
    accounting or the job-completion log; None if nobody knows the job."""
    found = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    if found.returncode == 0 and (status := parse_scontrol_job(found.stdout)):
        return status
    for extra in ([], ["-c"]):
        cmd = ["sacct", *extra, "-j", job_id, "-n", "-P", "-X", "-o", "State,ExitCode"]
        try:
            acct = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            return None
        rows = [line.split("|") for line in acct.stdout.splitlines() if "|" in line]
        if acct.returncode == 0 and rows:
            return JobStatus(rows[0][0].split()[0], rows[0][1])  # "CANCELLED by 0" -> CANCELLED
    return None


@dataclass(frozen=True)
class SlurmRun:
    """A job that ended COMPLETED."""

    job_id: str
    log_path: Path
    seconds: float


def follow(
    job_id: str,
    log_path: str | Path,
    *,
    timeout_s: float | None,
    stuck_s: float | None = None,
    poll_s: float = 2.0,
) -> SlurmRun:
    """Wait for the job to end. COMPLETED returns; any other end raises ``LaunchError``. ``timeout_s`` (from now,
    pending time included; None: no limit) and ``stuck_s`` (no growth of the job log while RUNNING) cancel the job
    and raise."""
    log_path = Path(log_path)
    start = time.monotonic()
    last_size, last_change = -1, start
    while True:
        status = job_status(job_id)
        now = time.monotonic()
        if status is None:
            message = f"Slurm job {job_id} is unknown to scontrol and sacct"
            raise LaunchError(message, kind="lost", log_path=log_path, log_tail=tail(log_path))
        if status.state in DONE_STATES:
            break
        guard = None
        if timeout_s is not None and now - start > timeout_s:
            guard = ("timeout", f"not finished after {timeout_s:g} s (state {status.state})")
        if status.state == "RUNNING":
            size = log_path.stat().st_size if log_path.exists() else -1
            if size != last_size:
                last_size, last_change = size, now
            elif stuck_s is not None and now - last_change > stuck_s:
                guard = ("stuck", f"no new output in {log_path} for {stuck_s:g} s")
        else:
            last_change = now
        if guard:
            cancel(job_id)
            kind, why = guard
            message = f"Slurm job {job_id}: {kind}: {why}; cancelled it"
            raise LaunchError(message, kind=kind, state=status.state, log_path=log_path, log_tail=tail(log_path))
        time.sleep(poll_s)

    seconds = time.monotonic() - start
    if status.state == "COMPLETED":
        return SlurmRun(job_id, log_path, seconds)
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    failure = first_failure(parse_root_causes(text))
    rank = f"; first failed: {failure.describe()}" if failure else ""
    log_tail = tail(log_path)
    if failure and (own := rank_lines(text, failure)):
        log_tail = f"[rank {failure.rank}]\n{own}\n[job log]\n{tail(log_path, 20)}"
    raise LaunchError(
        f"Slurm job {job_id} {status.state} with exit code {status.exit_code}{rank} (log: {log_path})",
        kind=status.state.lower(),
        failure=failure,
        state=status.state,
        exit_code=status.exit_code,
        log_path=log_path,
        log_tail=log_tail,
    )


def launch(
    cfg: Any,
    command: Sequence[str],
    *,
    log_dir: str | Path,
    timeout_s: float | None,
    job_name: str = "grpo",
    time_limit_min: int = 60,
    stop_warning_s: int | None = None,
    port: int = 29500,
    sbatch_options: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    secret_env: Mapping[str, str] | None = None,
    stuck_s: float | None = None,
    poll_s: float = 2.0,
) -> SlurmRun:
    """Write ``log_dir/job.sbatch`` for ``cfg.trainer`` (nnodes, n_gpus_per_node, device, env) and ``command``,
    submit it from ``log_dir`` and follow it; the job log is ``log_dir/slurm-<jobid>.log``, the ranks' own
    logs go under ``log_dir/ranks/``; ``secret_env`` goes through sbatch's environment, ``extra_env`` in the
    script. Raises ``LaunchError`` unless the job ends COMPLETED; ``timeout_s``
    (``launch.timeout_s``; None: no limit) and ``stuck_s`` cancel it as ``follow`` says."""
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    shape = JobShape.from_config(cfg)
    script = sbatch_script(
        command,
        shape,
        log_path=log_dir / "slurm-%j.log",
        job_name=job_name,
        time_limit_min=time_limit_min,
        stop_warning_s=stop_warning_s,
        port=port,
        rank_log_dir=log_dir / "ranks",
        sbatch_options=sbatch_options,
        extra_env=extra_env,
        secret_env=secret_env,
        workdir=Path.cwd(),
    )
    script_path = log_dir / "job.sbatch"
    script_path.write_text(script)
    job_id = submit(script_path, {**shape.env, **(secret_env or {})})
    log.info("submitted Slurm job %s (log: %s)", job_id, log_dir / f"slurm-{job_id}.log")
    return follow(job_id, log_dir / f"slurm-{job_id}.log", timeout_s=timeout_s, stuck_s=stuck_s, poll_s=poll_s)


def _setting(variable: str, shape: JobShape) -> str:
    """Where an environment variable the script checks comes from, for its message."""
    return f"trainer.env.{variable}" if variable in shape.env else "a secret-looking override"


def _run(cmd: list[str], env: Mapping[str, str] | None = None) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env} if env else None)
    if result.returncode != 0:
        raise LaunchError(
            f"{shlex.join(cmd)} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}",
            kind="submit",
        )
    return result.stdout
