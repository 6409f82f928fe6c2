"""grpo_core.launch.torchrun: the torchrun command line, and real runs of tests/dist/allreduce_worker.py
(gloo on CPU) on one node and on two simulated nodes (two torchrun agents on this host, c10d rendezvous on
127.0.0.1), including a failing rank, a killed rank and a hanging rank; then ``run_training`` with the real
trainer (a tiny model, 2 steps) on two simulated nodes, completing and with one node's rank killed."""

import contextlib
import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_core.config import load_config
from grpo_core.config.schema import GRPOConfig
from grpo_core.launch import JobShape, LaunchError, run_training, trainer_command
from grpo_core.launch.common import first_failure, parse_root_causes
from grpo_core.launch.torchrun import NodeLogs, launch, run_node, torchrun_argv
from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir
from tests.test_train import base_overrides

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "dist" / "allreduce_worker.py")
PY = sys.executable
FAILURE_BOUND_S = 60  # a failure must be reported within this many seconds


def cfg(nnodes: int = 1, nproc: int = 2, **env: str) -> dict:
    return {
        "trainer": {
            "nnodes": nnodes,
            "n_gpus_per_node": nproc,
            "device": "cpu",
            "env": {"OMP_NUM_THREADS": "1", **env},
        }
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Running (a zombie no reaper collected counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def worker(out: Path, *args: str) -> list[str]:
    return [PY, WORKER, "--out", str(out), *args]


def results(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def launch_nodes(config: dict, command: list[str], log_dir: Path, **kwargs) -> list[object]:
    """Both nodes of a 2-node job, each a ``launch`` call in its own thread: [NodeRun or LaunchError] per node."""
    port, outcome = free_port(), [None, None]

    def node(rank: int) -> None:
        try:
            endpoint = f"127.0.0.1:{port}"
            outcome[rank] = launch(
                config,
                command,
                log_dir=log_dir,
                node_rank=rank,
                rdzv_endpoint=endpoint,
                rdzv_id="t",
                rdzv_timeout_s=60,
                **kwargs,
            )
        except LaunchError as e:
            outcome[rank] = e

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


# --- the command line -----------------------------------------------------------------------------------


def test_argv_one_node_runs_the_trainer_module_on_loopback():
    command = trainer_command("configs/grpo_base.yaml", ["trainer.total_training_steps=2"], python="/venv/bin/python")
    assert torchrun_argv(command, nproc_per_node=8) == [
        "/venv/bin/python", "-m", "grpo_core.launch.agent",
        "--nnodes=1", "--node-rank=0", "--rdzv-backend=grpo", "--local-addr=127.0.0.1",
        "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=grpo", "--rdzv-conf=join_timeout=600",
        "--nproc-per-node=8", "--max-restarts=0",
        "-m", "grpo_core.main_ppo", "--config", "configs/grpo_base.yaml", "trainer.total_training_steps=2",
    ]  # fmt: skip


def test_argv_multi_node_uses_a_rendezvous_on_the_endpoints_address():
    def argv(node_rank):
        return torchrun_argv(
            ["/venv/bin/python", "train.py", "--lr", "1e-6"],
            nproc_per_node=8, nnodes=4, node_rank=node_rank, rdzv_endpoint="10.0.0.1:29500", rdzv_id="run7",
            rdzv_timeout_s=300, log_dir="/logs/node2-ranks",
        )  # fmt: skip

    assert argv(2) == [
        "/venv/bin/python", "-m", "grpo_core.launch.agent",
        "--nnodes=4", "--node-rank=2", "--rdzv-backend=grpo", "--rdzv-endpoint=10.0.0.1:29500", "--rdzv-id=run7",
        "--rdzv-conf=join_timeout=300", "--nproc-per-node=8", "--max-restarts=0",
        "--log-dir=/logs/node2-ranks", "--tee=3",
        "train.py", "--lr", "1e-6",
    ]  # fmt: skip
    assert "--local-addr=10.0.0.1" in argv(0)  # node 0 hosts the ranks' store where the rendezvous listens
    assert "--rdzv-backend=c10d" in argv(None)  # Slurm: torch's own, each node's address Slurm's


def test_argv_checks():
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_argv([PY, "train.py"], nproc_per_node=8, nnodes=2)
    with pytest.raises(ValueError, match="script or -m module"):
        torchrun_argv([PY, "-u", "train.py"], nproc_per_node=1)
    # Anything that is not a Python command runs as it is, under this interpreter's torchrun.
    assert torchrun_argv(["./train.sh", "x"], nproc_per_node=2)[-3:] == ["--no-python", "./train.sh", "x"]


def test_job_shape_from_the_typed_config_and_from_a_dict():
    shape = JobShape.from_config(GRPOConfig())
    assert (shape.nnodes, shape.nproc_per_node, shape.device) == (1, 8, "cuda")
    assert shape.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert JobShape.from_config(cfg(2, 4, A="1")) == JobShape(2, 4, "cpu", {"OMP_NUM_THREADS": "1", "A": "1"})


def test_root_cause_parsing_prefers_the_real_failure_on_a_tie():
    report = """{label}Root Cause (first observed failure):
{label}[0]:
{label}  time      : 2026-11-30_01:13:35
{label}  host      : n1
{label}  rank      : {rank} (local_rank: 0)
{label}  exitcode  : {code} (pid: 14608)
{label}  error_file: <N/A>
{label}============================================================"""
    text = report.format(label="0: ", rank=0, code=1) + "\n" + report.format(label="1: ", rank=3, code=7)
    failures = parse_root_causes(text)
    assert [(f.rank, f.exit_code, f.node_label) for f in failures] == [(0, 1, "0"), (3, 7, "1")]
    assert first_failure(failures).rank == 3
    assert first_failure(parse_root_causes(report.format(label="", rank=2, code=-9))).describe() == (
        "rank 2 (local rank 0) was killed by SIGKILL (exit code -9)"
    )


# --- the runner on plain commands (no torch) ------------------------------------------------------------


def test_heartbeat_keeps_a_silent_job_alive_and_detached_children_are_killed(tmp_path):
    orphan = tmp_path / "orphan.pid"
    beat = 'for i in 1 2 3 4 5 6; do touch "$GRPO_HEARTBEAT_FILE"; sleep 1; done'
    script = f"setsid sleep 600 & echo $! > {orphan}; {beat}"
    run = run_node(["bash", "-c", script], NodeLogs(tmp_path), stuck_s=3, poll_s=0.2)
    assert run.seconds > 5  # silent for 6 s with stuck_s=3, yet not stuck
    assert not alive(int(orphan.read_text()))


def test_a_launcher_killed_outright_takes_its_agent_with_it(tmp_path):
    """SIGKILL to the launching process (a Prefect worker cancelling a flow run after its grace, the OOM killer)
    leaves it no time to clean up: the kernel SIGTERMs the agent (PR_SET_PDEATHSIG), which stops its ranks."""
    agent_pid = tmp_path / "agent.pid"
    launcher = (
        "from pathlib import Path\n"
        "from grpo_core.launch.torchrun import NodeLogs, run_node\n"
        f"run_node(['bash', '-c', 'echo $$ > {agent_pid}; exec sleep 600'], NodeLogs(Path({str(tmp_path)!r})))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (agent_pid.is_file() and agent_pid.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    agent = int(agent_pid.read_text())
    assert alive(agent)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while alive(agent) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(agent), "the agent outlived its launcher"


def test_an_agent_that_fails_before_any_rank_names_its_last_line(tmp_path):
    with pytest.raises(LaunchError, match="torchrun exited with code 3 before any rank failed: rendezvous broke"):
        run_node(["bash", "-c", "echo rendezvous broke; exit 3"], NodeLogs(tmp_path, node_rank=1))


FAILED_AGENT = """
own="$RANKS/run/attempt_0/0" && mkdir -p "$own"
printf 'step 1: reward 0.5\\nerror: saving checkpoint /c/step_000001 failed: disk full\\n' > "$own/stderr.log"
cat <<'EOF'
[default0]:step 1: reward 0.5
[default0]:Exception in thread Thread-2 (_write_files_from_queue):
[default0]:Traceback (most recent call last):
[default0]:  File "torch/distributed/checkpoint/filesystem.py", line 269, in write
[default0]:    return self.raw.write(b)
[default0]:OSError: [Errno 28] No space left on device
[default0]:error: saving checkpoint /c/step_000001 failed: disk full
E1206 19:45:10.691000 9148 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
grpo_core.main_ppo FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_19:45:10
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 9153)
  error_file: <N/A>
============================================================
EOF
exit 1
"""
"""What torchrun's agent prints when its rank fails to save a checkpoint on a full disk (shortened): the rank's
lines with its writer thread's traceback, then torchrun's own log record, traceback and report."""


def test_a_failed_rank_is_one_line_with_what_it_said_and_the_terminal_gets_no_traceback(tmp_path):
    """Issue 42: the error names the rank and what it said (its own error line); the echo shows the ranks' lines
    without tracebacks (an exception's own line is kept), and none of torchrun's; the report's tail neither."""
    from grpo_core.launch.run import LogEcho

    logs, agent = NodeLogs(tmp_path / "logs"), tmp_path / "agent.sh"
    agent.write_text(FAILED_AGENT)
    with pytest.raises(LaunchError) as info:
        run_node(["bash", str(agent)], logs, env={"RANKS": str(logs.rank_dir)})
    says = "rank 0 (local rank 0) exited with code 1: saving checkpoint /c/step_000001 failed: disk full (log: "
    assert str(info.value).startswith(f"node 0: {says}"), str(info.value)
    echoed = io.StringIO()
    LogEcho(lambda: logs.node_log, echoed).copy(last=True)
    assert echoed.getvalue().splitlines() == [  # the command line stays in the log: the terminal said it short
        "[default0]:step 1: reward 0.5",
        "[default0]:OSError: [Errno 28] No space left on device",
        "[default0]:error: saving checkpoint /c/step_000001 failed: disk full",
    ]
    assert "Traceback" not in info.value.report() and "disk full" in info.value.report()
    assert "ChildFailedError" in logs.node_log.read_text()  # all of it stays in the log


RANK_THAT_SAVES = (  # a "rank" (a child of the agent): on SIGTERM it says so and exits 0, as the trainer does
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (print('rank saved its step', flush=True), sys.exit(0)))\n"
    "time.sleep(60)"
)


def test_the_timeout_asks_the_ranks_to_stop_and_they_save_their_step(tmp_path):
    """At ``timeout_s`` the ranks (not the agent) get SIGTERM and ``stop_grace_s`` to finish; the job ends with
    a timeout that says they stopped cleanly (exit code 0), not that they were killed."""
    agent = f"python3 -c {shlex.quote(RANK_THAT_SAVES)}; exit $?"
    with pytest.raises(LaunchError, match="the ranks saved their last step and stopped") as info:
        run_node(["bash", "-c", agent], NodeLogs(tmp_path), timeout_s=1, stop_grace_s=30, poll_s=0.2)
    assert info.value.kind == "timeout" and info.value.exit_code == 0
    assert "rank saved its step" in (tmp_path / "node0.log").read_text()


def test_the_pipeline_retries_a_failed_launch_but_not_a_stopped_one():
    """The train task's retry condition: a crashed rank or a hang is worth a retry; a run stopped on purpose or out
    of time (its last step saved) is not, or a cancelled pipeline would start training again 30 s later."""
    from prefect.states import Failed

    from tasks.retry import transient

    def retried(kind: str) -> bool:
        return transient(None, None, Failed(data=LaunchError("node 0: ...", kind=kind)))

    assert retried("failed") and retried("stuck") and retried("hang")
    assert not retried("stopped") and not retried("timeout") and not retried("cancelled")


def test_ranks_that_ignore_the_stop_request_are_killed_after_the_grace(tmp_path):
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    agent = f"python3 -c {shlex.quote(stubborn)}; exit $?"
    start = time.monotonic()
    with pytest.raises(LaunchError, match="killed the job") as info:
        run_node(["bash", "-c", agent], NodeLogs(tmp_path), timeout_s=1, stop_grace_s=1, grace_s=1, poll_s=0.2)
    assert info.value.exit_code is None and time.monotonic() - start < 30


def signal_the_agent_once_its_rank_runs(signum: int, pid_dir: Path, sent: list[float]) -> threading.Thread:
    """A thread that sends ``signum`` to a stand-in agent once it has written ``agent.pid`` and ``rank.pid``."""

    def send() -> None:
        deadline = time.monotonic() + 30
        while not (pid_dir / "rank.pid").is_file() or not (pid_dir / "rank.pid").read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(int((pid_dir / "agent.pid").read_text()), signum)
        sent.append(time.monotonic())

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("signum", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_stopped_or_dead_agent_ends_the_job_within_the_hang_limit(signum, tmp_path):
    """Issue 53: a stand-in agent (bash) whose "rank" (a sleep) keeps running: stopped, it is noticed after a third
    of ``hang_s``; killed, at once. One line either way, and the rank is killed."""
    agent = f"echo $$ > {tmp_path}/agent.pid; sleep 600 & echo $! > {tmp_path}/rank.pid; wait"
    sent: list[float] = []
    sender = signal_the_agent_once_its_rank_runs(signum, tmp_path, sent)
    with pytest.raises(LaunchError) as caught:
        run_node(["bash", "-c", agent], NodeLogs(tmp_path / "logs"), hang_s=3, stuck_s=60, poll_s=0.1)
    took = time.monotonic() - sent[0]
    sender.join()
    error, agent_pid = str(caught.value), int((tmp_path / "agent.pid").read_text())
    said = {
        signal.SIGSTOP: f"node 0: agent: torchrun's agent (pid {agent_pid}) has been stopped (SIGSTOP) for ",
        signal.SIGKILL: "node 0: agent: torchrun's agent was killed by SIGKILL; killed its ranks (log: ",
    }
    assert caught.value.kind == "agent" and error.startswith(said[signum]) and "\n" not in error, error
    assert took < 3, took  # within hang_s
    assert not alive(int((tmp_path / "rank.pid").read_text()))


# --- real runs ------------------------------------------------------------------------------------------


def test_one_node_two_ranks_complete_with_the_config_env_and_no_leftovers(tmp_path):
    out = tmp_path / "out"
    run = launch(cfg(GRPO_TEST_MARKER="from-config"), worker(out, "--orphan"), log_dir=tmp_path / "logs", stuck_s=60)
    got = results(out)
    assert sorted(got) == [0, 1]
    assert all(r["allreduce_sum"] == 3.0 and r["env_marker"] == "from-config" for r in got.values())
    assert "rank 1/2 step 0" in run.log_path.read_text()  # the node log has every rank's output
    # each rank left a `sleep 600` in a session of its own behind; the launcher killed it
    assert not any(alive(int((out / f"orphan-rank{r}").read_text())) for r in (0, 1))


RAISES = (
    "try:\n    {}['shape']\nexcept KeyError as e:\n    raise RuntimeError('adapter shape (4, 8), base (8, 4)') from e\n"
)
"""A rank that dies of an exception it does not catch, chained to another, and prints no ``error:`` line."""


def test_a_rank_that_raises_is_one_line_with_its_exception_and_the_echo_shows_no_traceback(tmp_path):
    """Issue 53, real torchrun: the error names the rank, the exception that ended it and its log (the pipeline,
    which has no echo, says why in one line too); the echo (what `grpo train` shows) keeps each exception's own line
    and none of the tracebacks, the rank's or torchrun's, which stay in the logs."""
    from grpo_core.launch.run import LogEcho

    logs, rank = NodeLogs(tmp_path / "logs", 0), tmp_path / "rank.py"
    rank.write_text(RAISES)
    with pytest.raises(LaunchError) as caught:
        launch(cfg(nproc=1), [PY, str(rank)], log_dir=logs.root, stuck_s=60)
    error = str(caught.value)
    said = "rank 0 (local rank 0) exited with code 1: RuntimeError: adapter shape (4, 8), base (8, 4) (log: "
    assert error.startswith(f"node 0: {said}") and "\n" not in error, error
    echoed = io.StringIO()
    LogEcho(lambda: logs.node_log, echoed).copy(last=True)
    shown = echoed.getvalue()
    assert "[default0]:RuntimeError: adapter shape (4, 8), base (8, 4)" in shown, shown
    assert "Traceback" not in shown + caught.value.report() and "ChildFailedError" not in shown, shown
    assert logs.node_log.read_text().count("Traceback (most recent call last)") >= 3  # 2 of the rank's, torchrun's


def test_two_nodes_complete(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    runs = launch_nodes(cfg(nnodes=2, nproc=1), worker(out, "--steps", "3"), tmp_path / "logs", stuck_s=60)
    print(f"2-node run: {time.monotonic() - start:.1f} s")
    assert not any(isinstance(r, LaunchError) for r in runs), runs
    got = results(out)
    assert sorted(got) == [0, 1]
    assert all(r["world_size"] == 2 and r["allreduce_sum"] == 9.0 for r in got.values())  # 3 steps x (1 + 2)


def test_two_nodes_a_rank_exiting_7_is_named_within_the_bound(tmp_path):
    out = tmp_path / "out"
    command = worker(out, "--steps", "5", "--fail-rank", "1", "--fail-step", "1")
    start = time.monotonic()
    errors = launch_nodes(cfg(nnodes=2, nproc=1), command, tmp_path / "logs", stuck_s=60)
    elapsed = time.monotonic() - start
    print(f"2-node failure detected on both nodes in {elapsed:.1f} s")
    assert all(isinstance(e, LaunchError) for e in errors), errors
    assert elapsed < FAILURE_BOUND_S
    # c10d decides which node holds rank 1; that node's error names it, the other node's is collateral
    root = next(e for e in errors if e.rank == 1)
    assert "rank 1 (local rank 0) exited with code 7" in str(root) and "\n" not in str(root)
    assert "failing on purpose with exit code 7" in root.log_tail
    assert first_failure([e.failure for e in errors if e.failure]).rank == 1


def test_two_nodes_a_killed_rank_is_named_within_the_bound(tmp_path):
    out = tmp_path / "out"
    command = worker(out, "--steps", "200", "--step-seconds", "0.2")

    def kill_rank_1() -> None:
        pid_file = out / "pid-rank1"
        while not (pid_file.exists() and pid_file.read_text() and (out / "pid-rank0").exists()):
            time.sleep(0.2)
        time.sleep(2)  # let the ranks get going
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    start = time.monotonic()
    errors = launch_nodes(cfg(nnodes=2, nproc=1), command, tmp_path / "logs", timeout_s=120, stuck_s=60)
    elapsed = time.monotonic() - start
    print(f"2-node run with rank 1 killed: both nodes failed after {elapsed:.1f} s")
    assert all(isinstance(e, LaunchError) for e in errors), errors
    assert elapsed < FAILURE_BOUND_S + 10  # the ranks need a few seconds to start before the kill
    root = next(e for e in errors if e.rank == 1)
    assert "rank 1 (local rank 0) was killed by SIGKILL (exit code -9)" in str(root)


def test_a_hanging_rank_is_killed_by_the_stuck_guard(tmp_path):
    out = tmp_path / "out"
    command = worker(out, "--steps", "3", "--hang-rank", "1", "--fail-step", "1")
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(cfg(), command, log_dir=tmp_path / "logs", stuck_s=20, timeout_s=120)
    elapsed = time.monotonic() - start
    print(f"hang detected and killed after {elapsed:.1f} s")
    assert caught.value.kind == "stuck" and "no output and no heartbeat for 20 s" in str(caught.value)
    assert "rank 0/2 step 0" in caught.value.log_tail  # it did hang after a step, not while starting
    assert elapsed < FAILURE_BOUND_S
    assert not any(alive(int(p.read_text())) for p in out.glob("pid-rank*"))


def test_the_overall_timeout_kills_a_job_that_keeps_printing(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(cfg(), worker(out, "--steps", "1000", "--step-seconds", "0.2"), log_dir=tmp_path / "logs", timeout_s=15)
    assert caught.value.kind == "timeout"
    assert time.monotonic() - start < 15 + FAILURE_BOUND_S / 2
    assert not any(alive(int(p.read_text())) for p in out.glob("pid-rank*"))


# --- the real trainer (run_training) on two simulated nodes ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """(tiny model directory, capitals data directory), absolute tmp paths."""
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    root = tmp_path_factory.mktemp("tiny")
    return tiny_model_dir(root / "model"), capitals_data(root / "data")


def small_steps(tiny_inputs: tuple[Path, Path], steps: int) -> list[str]:
    """test_train's tiny run with half the prompts and responses per step: 4 x 4, 8 per rank on 2 nodes."""
    return [
        *base_overrides(*tiny_inputs, steps),
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.n=4",
    ]


def node_overrides(run_dir: Path, tiny_inputs: tuple[Path, Path], steps: int, port: int, node_rank: int) -> list[str]:
    return [
        *small_steps(tiny_inputs, steps),
        f"trainer.default_local_dir={run_dir}",
        "trainer.nnodes=2",
        f"launch.node_rank={node_rank}",
        f"launch.rdzv_endpoint=127.0.0.1:{port}",
        f"launch.rdzv_id={run_dir.name}",
        "launch.stuck_timeout_s=90",
        "launch.timeout_s=300",
    ]


def train_two_nodes(run_dir: Path, tiny_inputs: tuple[Path, Path], steps: int, marker: str) -> list[object]:
    """``run_training`` for node 0 and node 1, each in its own thread: [log dir or LaunchError] per node. Every
    process a node starts carries ``GRPO_TEST_NODE=<marker>-<node>`` in its environment."""
    port, outcome = free_port(), [None, None]

    def node(rank: int) -> None:
        overrides = node_overrides(run_dir, tiny_inputs, steps, port, rank)
        env = {"OMP_NUM_THREADS": "1", "GRPO_TEST_NODE": f"{marker}-{rank}"}
        try:
            outcome[rank] = run_training(load_config(None, overrides), None, overrides, extra_env=env)
        except LaunchError as e:
            outcome[rank] = e

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment holds ``GRPO_TEST_NODE`` starting with ``marker``."""
    prefix = f"GRPO_TEST_NODE={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if any(var.startswith(prefix) for var in environ.split(b"\0")) and alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def rank_pid(marker: str) -> int | None:
    """The trainer rank among the marked processes: torchrun set LOCAL_RANK for it, but not for its parent
    (the agent); its own children (a checkpoint writer, say) have a parent with LOCAL_RANK."""

    def is_rank(pid: int) -> bool:
        try:
            return b"LOCAL_RANK" in {v.split(b"=")[0] for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")}
        except OSError:
            return False

    for pid in marked_pids(marker):
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if is_rank(pid) and not is_rank(ppid):
            return pid
    return None


def test_two_node_training_completes_with_metrics_and_a_checkpoint(tmp_path, tiny_inputs):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    outcome = train_two_nodes(run_dir, tiny_inputs, steps=2, marker=run_dir.name + "ok")
    print(f"2-node tiny training (2 steps): {time.monotonic() - start:.1f} s")
    assert outcome == [run_dir / "launch", run_dir / "launch"], outcome
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    logs = [(run_dir / "launch" / f"node{node}.log").read_text() for node in (0, 1)]
    assert any("step 2/2:" in text for text in logs)  # rank 0's per-step line, on whichever node c10d put it
    assert not marked_pids(run_dir.name + "ok")


def test_two_node_training_with_a_killed_rank_fails_within_the_bound(tmp_path, tiny_inputs):
    run_dir, marker = tmp_path / "run", f"{tmp_path.name}-kill"
    killed_at: list[float] = []

    def kill_node_1_rank_after_step_1() -> None:
        metrics_file = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (metrics_file.exists() and metrics_file.read_text().strip()):
            time.sleep(0.2)
        if (pid := rank_pid(f"{marker}-1")) is not None:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_node_1_rank_after_step_1, daemon=True)
    killer.start()
    errors = train_two_nodes(run_dir, tiny_inputs, steps=20, marker=marker)
    done = time.monotonic()
    killer.join()
    assert killed_at, "the rank on node 1 was not found"
    print(f"2-node tiny training, node 1's rank killed after step 1: both failed {done - killed_at[0]:.1f} s later")
    assert all(isinstance(e, LaunchError) for e in errors), errors
    print("\n".join(map(str, errors)))
    assert done - killed_at[0] < FAILURE_BOUND_S
    assert str(errors[1]).startswith("node 1: rank ") and "was killed by SIGKILL (exit code -9)" in str(errors[1])
    assert "\n" not in str(errors[1]) and errors[1].log_tail
    assert str(errors[0]).startswith("node 0: ")
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) < 20  # it did stop mid-run
    assert not marked_pids(marker)


# --- issue 53: `grpo train` with a secret-looking override, its agent stopped mid-run ------------------------

WEBHOOK = "https://bot:plantedpw@hooks.example/services/plantedtoken"  # a password and a token in its path
WEBHOOK_PARTS = ("plantedpw", "plantedtoken")
AGENT_HANG_S = 12  # trainer.hang_timeout_s: a healthy phase of the tiny run takes a second or two


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_grpo_train_keeps_a_secret_off_every_command_line_and_ends_a_stopped_agent_within_the_hang_limit(
    tmp_path, tiny_inputs
):
    """The real trainer under real torchrun. `grpo train` is given a webhook URL with a password and a token in its
    path; once the rank has trained a step (so its config, the URL read back from its environment, resolved), no
    command line of the processes it started holds either part: the rank's names the variable, its environment
    holds the value. Then the agent is stopped (SIGSTOP): the launcher ends the run within
    ``trainer.hang_timeout_s`` in one line, exit 1, nothing left running, and the secret is in no file of the run."""
    run_dir, marker = tmp_path / "run", f"{tmp_path.name}-secret"
    overrides = [
        *small_steps(tiny_inputs, 50),
        f"trainer.default_local_dir={run_dir}",
        f"trainer.hang_timeout_s={AGENT_HANG_S}",
        f"tracking.notify_webhook_url={WEBHOOK}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "GRPO_TEST_NODE": marker}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        cmd = [PY, "-m", "grpo_core.cli", "train", *overrides]
        launcher = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=REPO)
    try:
        metrics_file, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
        while not (metrics_file.is_file() and metrics_file.read_text().strip()):
            assert launcher.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        rank, started = rank_pid(marker), [pid for pid in marked_pids(marker) if pid != launcher.pid]
        agent = next(pid for pid in started if "grpo_core.launch.agent" in cmdline(pid))
        assert rank in started and not [pid for pid in started if any(p in cmdline(pid) for p in WEBHOOK_PARTS)]
        assert "tracking.notify_webhook_url=${oc.env:GRPO_TRACKING_NOTIFY_WEBHOOK_URL}" in cmdline(rank)
        environ = Path(f"/proc/{rank}/environ").read_bytes().split(b"\0")
        assert f"GRPO_TRACKING_NOTIFY_WEBHOOK_URL={WEBHOOK}".encode() in environ
        os.kill(agent, signal.SIGSTOP)
        stopped = time.monotonic()
        code = launcher.wait(timeout=AGENT_HANG_S + 60)
        took = time.monotonic() - stopped
    finally:
        launcher.kill()
        for pid in marked_pids(marker):  # only when something above failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    said = err.read_text()
    errors = [line for line in said.splitlines() if line.startswith("error: ")]
    print(f"the stopped agent ended the run {took:.1f} s after SIGSTOP (trainer.hang_timeout_s={AGENT_HANG_S})")
    print(errors[0] if errors else said[-3000:])
    assert code == 1 and len(errors) == 1 and "Traceback" not in said, said[-3000:]
    line = f"error: node 0: agent: torchrun's agent (pid {agent}) has been stopped (SIGSTOP) for "
    assert errors[0].startswith(line) and "; killed the job after " in errors[0], errors[0]
    assert took < AGENT_HANG_S
    assert not marked_pids(marker)
    files = [path for path in [*run_dir.rglob("*"), out, err] if path.is_file()]
    assert not [path for path in files if any(part.encode() in path.read_bytes() for part in WEBHOOK_PARTS)]
