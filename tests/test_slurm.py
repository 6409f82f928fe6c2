"""grpo_core.launch.slurm: the batch script (pure), and real jobs on a two-node Slurm cluster that
tests/slurm/start_cluster.sh starts on this machine (installing Slurm with apt-get if it is missing and we
are root): a 2-node sbatch + srun + torchrun job of tests/dist/allreduce_worker.py, a failing one and a
cancelled one; and the real trainer (a tiny model, 2 steps) on 2 nodes through ``run_training``."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_core.config import load_config
from grpo_core.launch import JobShape, LaunchError, run_training, trainer_command
from grpo_core.launch.slurm import (
    JobStatus,
    cancel,
    follow,
    job_status,
    launch,
    parse_scontrol_job,
    sbatch_script,
    submit,
)
from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir
from tests.test_launch import small_steps

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "dist" / "allreduce_worker.py")
CLUSTER_DIR = Path(os.environ.get("GRPO_SLURM_DIR", "/tmp/grpo-slurm"))
SKIP_STATUS = 77  # start_cluster.sh: "cannot run here"
CFG = {"trainer": {"nnodes": 2, "n_gpus_per_node": 1, "device": "cpu", "env": {"OMP_NUM_THREADS": "1"}}}


# --- pure parts -----------------------------------------------------------------------------------------


def test_sbatch_script_for_two_gpu_nodes():
    shape = JobShape(nnodes=2, nproc_per_node=8, device="cuda", env={"NCCL_DEBUG": "WARN", "MY_PAT": "planted"})
    command = trainer_command("/runs/7/config.yaml", ["trainer.total_training_steps=10"], python="/venv/bin/python")
    options = ["--partition=gpu"]
    text = sbatch_script(
        command,
        shape,
        log_path="/runs/7/slurm-%j.log",
        time_limit_min=90,
        stop_warning_s=300,
        port=29400,
        sbatch_options=options,
        extra_env={"X": "a b"},
    )
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=90",
        "#SBATCH --signal=USR1@300",  # the ranks' warning: finish the step, save it, stop
        "#SBATCH --output=/runs/7/slurm-%j.log",
        "#SBATCH --partition=gpu",
        "export X='a b'",
        ': "${NCCL_DEBUG?not passed on by sbatch (trainer.env.NCCL_DEBUG)}"',  # trainer.env: sbatch's environment
        ': "${MY_PAT?not passed on by sbatch (trainer.env.MY_PAT)}"',
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
    ]:
        assert line in text.splitlines(), line
    assert '--node-rank="$SLURM_NODEID"' in text  # expanded per task, not by the batch shell
    assert 'trap "" USR1; exec "$0" -m torch.distributed.run' in text  # torchrun's agent would die of it
    assert (
        "--nnodes=$SLURM_NNODES --rdzv-backend=c10d --rdzv-endpoint=$head_addr:29400 --rdzv-id=$SLURM_JOB_ID "
        "--rdzv-conf=join_timeout=600 --nproc-per-node=8 --max-restarts=0 "
        "-m grpo_core.main_ppo --config /runs/7/config.yaml trainer.total_training_steps=10"
    ) in text
    assert "WARN" not in text and "planted" not in text  # the script is a file in the run directory
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_no_early_warning_where_it_would_come_at_the_start():
    args = dict(command=[sys.executable, WORKER], shape=JobShape(1, 1, "cpu", {}), log_path="x.log", stop_warning_s=300)
    assert "#SBATCH --signal=USR1@300" in sbatch_script(**args, time_limit_min=11).splitlines()
    assert "#SBATCH --signal" not in sbatch_script(**args, time_limit_min=10)  # 300 s of a 600 s job: half of it


def test_sbatch_script_on_cpu_asks_for_no_gpus():
    text = sbatch_script([sys.executable, WORKER], JobShape(1, 2, "cpu", {}), log_path="x.log")
    assert "--gpus-per-node" not in text and "#SBATCH --nodes=1" in text


def test_parse_scontrol_job():
    text = "JobId=12 JobName=grpo JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0 DerivedExitCode=0:0"
    assert parse_scontrol_job(text) == JobStatus("FAILED", "1:0")
    assert parse_scontrol_job("slurm_load_jobs error: Invalid job id specified") is None


# --- a real cluster -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster():
    """Start the two-node cluster once for the session (see tests/slurm/start_cluster.sh); skip only where it
    cannot run (not root, no apt-get)."""
    start = time.monotonic()
    started = subprocess.run(["bash", str(REPO / "tests/slurm/start_cluster.sh")], capture_output=True, text=True)
    if started.returncode == SKIP_STATUS:
        pytest.skip(started.stderr.strip().splitlines()[-1])
    assert started.returncode == 0, f"start_cluster.sh failed:\n{started.stdout}\n{started.stderr}"
    print(f"\nSlurm cluster up in {time.monotonic() - start:.1f} s")
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(CLUSTER_DIR / "slurm.conf")
    yield
    subprocess.run(["bash", str(REPO / "tests/slurm/stop_cluster.sh")], check=False)
    if saved is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = saved


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(out: Path, *args: str) -> list[str]:
    return [sys.executable, WORKER, "--out", str(out), *args]


def test_two_node_job_completes(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    run = launch(
        CFG, worker(out, "--steps", "2"), log_dir=tmp_path / "logs", port=free_port(), timeout_s=180, poll_s=0.5
    )
    print(f"2-node Slurm job {run.job_id} COMPLETED in {time.monotonic() - start:.1f} s")
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world_size"] == 2 and r["allreduce_sum"] == 6.0 for r in got)
    text = run.log_path.read_text()
    assert "0: [default0]:rank" in text and "1: [default0]:rank" in text  # one agent on each node


def test_failing_job_reports_failed_with_the_rank_and_log_tail(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        command = worker(out, "--steps", "5", "--fail-rank", "1", "--fail-step", "1")
        launch(CFG, command, log_dir=tmp_path / "logs", port=free_port(), timeout_s=180, poll_s=0.5)
    error = caught.value
    print(f"failing Slurm job reported in {time.monotonic() - start:.1f} s: {error}")
    assert error.state == "FAILED" and error.kind == "failed"
    assert error.exit_code not in ("", "0:0")
    assert f"FAILED with exit code {error.exit_code}" in str(error)
    assert "first failed: rank 1 (local rank 0) exited with code 7" in str(error)
    assert "failing on purpose with exit code 7" in error.log_tail


def test_cancelled_job_reports_cancelled(slurm_cluster, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    script = logs / "job.sbatch"
    command = worker(tmp_path / "out", "--steps", "1000", "--step-seconds", "0.5")
    script.write_text(sbatch_script(command, JobShape.from_config(CFG), log_path=logs / "job.log", port=free_port()))
    start = time.monotonic()
    job_id = submit(script, JobShape.from_config(CFG).env)  # trainer.env reaches the job through sbatch's environment
    while (status := job_status(job_id)) is not None and status.state == "PENDING":
        time.sleep(0.2)
    assert status is not None and status.state == "RUNNING"
    cancel(job_id)
    with pytest.raises(LaunchError) as caught:
        follow(job_id, logs / "job.log", timeout_s=60, poll_s=0.5)
    print(f"cancelled Slurm job {job_id} reported in {time.monotonic() - start:.1f} s: {caught.value}")
    assert caught.value.state == "CANCELLED" and caught.value.kind == "cancelled"
    assert f"Slurm job {job_id} CANCELLED with exit code" in str(caught.value)


def test_a_hanging_job_is_cancelled_by_the_stuck_guard(slurm_cluster, tmp_path):
    command = worker(tmp_path / "out", "--steps", "3", "--hang-rank", "1", "--fail-step", "1")
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(CFG, command, log_dir=tmp_path / "logs", port=free_port(), timeout_s=180, stuck_s=15, poll_s=0.5)
    print(f"hanging Slurm job cancelled after {time.monotonic() - start:.1f} s: {caught.value}")
    assert caught.value.kind == "stuck" and "cancelled it" in str(caught.value)
    assert time.monotonic() - start < 90


def slurm_training(tmp_path: Path, run_dir: Path, steps: int) -> list[str]:
    """The tiny trainer on the two nodes (skipped without the shared tokenizer)."""
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    inputs = tiny_model_dir(tmp_path / "model"), capitals_data(tmp_path / "data")
    return [
        *small_steps(inputs, steps),
        f"trainer.default_local_dir={run_dir}",
        "trainer.nnodes=2",
        "launch.launcher=slurm",
        f"launch.rdzv_endpoint=127.0.0.1:{free_port()}",  # Slurm uses its port only
    ]


def test_two_node_training_through_run_training(slurm_cluster, tmp_path):
    """The real trainer as a Slurm job: every path absolute, as the job starts in this process's directory."""
    run_dir = tmp_path / "run"
    overrides = [
        *slurm_training(tmp_path, run_dir, steps=2),
        "launch.timeout_s=300",
        "launch.slurm_time_limit_min=10",
        "launch.slurm_options=[--comment=grpo-test]",
    ]
    start = time.monotonic()
    log_dir = run_training(load_config(None, overrides), None, overrides, extra_env={"OMP_NUM_THREADS": "1"})
    print(f"2-node tiny training as a Slurm job: {time.monotonic() - start:.1f} s")
    assert log_dir == run_dir / "launch"
    assert "#SBATCH --comment=grpo-test" in (log_dir / "job.sbatch").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    (job_log,) = log_dir.glob("slurm-*.log")
    text = job_log.read_text()
    assert "0: [default0]:" in text and "1: [default0]:" in text  # a rank on each node


def test_slurms_early_warning_stops_the_ranks_after_a_saved_step(slurm_cluster, tmp_path):
    """SIGUSR1 to every process of the job (`scancel --signal=USR1`, what `sbatch --signal=USR1@SECONDS` does
    before the time limit): torchrun's agents ignore it, the ranks finish their step, save it and stop, and the
    job completes; without the agents' "ignore" they would die of it and the job fail."""
    run_dir = tmp_path / "run"
    overrides = [
        *slurm_training(tmp_path, run_dir, steps=40),
        "trainer.save_freq=-1",
        "launch.timeout_s=600",
        "launch.slurm_time_limit_min=15",
    ]
    metrics = run_dir / "metrics.jsonl"

    def warn_when_training() -> None:
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.5)
        [log] = (run_dir / "launch").glob("slurm-*.log")
        subprocess.run(["scancel", "--signal=USR1", log.stem.removeprefix("slurm-")], check=True)

    warner = threading.Thread(target=warn_when_training, daemon=True)
    warner.start()
    run_training(load_config(None, overrides), None, overrides, extra_env={"OMP_NUM_THREADS": "1"})
    warner.join()
    assert "#SBATCH --signal=USR1@300" in (run_dir / "launch" / "job.sbatch").read_text()  # launch.stop_grace_s
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 40, steps
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps[-1]:06d}"
    [log] = (run_dir / "launch").glob("slurm-*.log")
    assert f"SIGUSR1: stopped after step {steps[-1]} of 40, its checkpoint saved" in log.read_text()
