"""One run directory, one run at a time, between real processes: a second `grpo pipeline` on a busy directory
fails at once naming the holder and touches nothing; `grpo train --wait` waits for it; a dead holder's lock
is taken over with a warning."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from grpo_core.launch.run_lock import HOLDER_FILE, acquire, read_holder, release
from tests.conftest import REPO
from tests.support.servers import prefect_env
from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir

HOLD = """
import sys, time
from grpo_core.launch.run_lock import hold_until_exit
hold_until_exit(sys.argv[1], flow_run="nightly-1234")
print("held", flush=True)
sys.stdin.read()  # until the test closes stdin
"""


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def holder_process(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env()
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def grpo(*args: str, cwd: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "grpo_core.cli", *args]
    isolated = {**env(), **prefect_env(cwd / "prefect")}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=isolated, cwd=cwd)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=1)


def overrides(root: Path, model: Path) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files=[{root / 'data' / 'train.parquet'}]",
        f"data.val_files=[{root / 'data' / 'test.parquet'}]",
        f"trainer.default_local_dir={root / 'run'}",
        f"tracking.mlflow_tracking_uri=sqlite:///{root / 'mlflow.db'}",
    ]


def listing(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in sorted(run_dir.rglob("*"))}


def test_a_second_pipeline_on_a_busy_run_directory_fails_at_once_naming_the_holder(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # the first run's files
    holder = holder_process(run_dir)
    try:
        before = listing(run_dir)
        start = time.monotonic()
        second = grpo(
            "pipeline", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides(tmp_path, tiny_model), cwd=tmp_path
        )
        second.wait(timeout=300)
        seconds = time.monotonic() - start
        err = second.stderr.read()
        print(f"second pipeline refused in {seconds:.1f} s: {err.strip()}")
        assert second.returncode == 1
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in err
        assert f"pid {holder.pid}" in errors[0] and "Prefect flow run nightly-1234" in errors[0]
        assert str(run_dir) in errors[0] and "--wait" in errors[0]
        assert listing(run_dir) == before  # nothing of the first run touched
        assert not (tmp_path / "data").exists() and not (tmp_path / "mlflow.db").exists()  # nothing started
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not (run_dir / HOLDER_FILE).exists()  # let go on exit


def test_a_refused_input_creates_no_run_directory(tmp_path, tiny_model):
    """Every input is checked before the run directory is made or held: a refused run leaves nothing behind."""
    run_dir = tmp_path / "nested" / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_core.cli", "train", "--config", str(REPO / "configs/demo_cpu.yaml")]
        + [*overrides(tmp_path, tiny_model)[:-2], f"trainer.default_local_dir={run_dir}"],
        capture_output=True,
        text=True,
        env=env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2 and "do not exist; write them with `grpo prepare`" in proc.stderr, proc.stderr
    assert not (tmp_path / "nested").exists()


def test_train_with_wait_waits_for_the_holder_then_goes_on(tmp_path, tiny_model):
    run_dir, log = tmp_path / "run", tmp_path / "train.err"
    capitals_data(tmp_path / "data")
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)  # what the holder's run left: damaged
    (run_dir / "checkpoints" / "step_000001" / "trainer_state.json").write_text("{}")
    holder = holder_process(run_dir)
    try:
        cmd = [
            sys.executable,
            "-m",
            "grpo_core.cli",
            "train",
            "--wait",
            "--config",
            str(REPO / "configs/demo_cpu.yaml"),
        ]
        with log.open("w") as err:
            waiting = subprocess.Popen(cmd + overrides(tmp_path, tiny_model), stderr=err, env=env(), cwd=tmp_path)
        deadline = time.monotonic() + 300
        while "waiting for it" not in log.read_text() and waiting.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(2)
        assert waiting.poll() is None, log.read_text()  # still waiting, not failed
        assert f"pid {holder.pid}" in log.read_text() and read_holder(run_dir).pid == holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    waiting.wait(timeout=300)
    # past the lock: the run directory is read (its one checkpoint is damaged, which stops it)
    assert waiting.returncode == 2 and "no intact checkpoint in" in log.read_text(), log.read_text()


BLOCKING_REWARD = """
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    while os.path.exists({flag!r}):  # the test holds the step in flight here
        time.sleep(0.1)
    return 0.0
"""


def test_a_killed_launchers_agent_and_ranks_keep_the_run_directory_until_they_end(tmp_path):
    """SIGKILL of `grpo train` leaves its agent and ranks finishing the step in flight: a new run on the same
    directory refuses in one line while any of them lives, or waits for them (--wait), then resumes; the two
    runs never write at once (each step is written once)."""
    from tests.test_train import base_overrides, metrics

    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    flag, reward, run_dir = tmp_path / "hold", tmp_path / "reward.py", tmp_path / "run"
    reward.write_text(BLOCKING_REWARD.format(flag=str(flag)))
    model, data = tiny_model_dir(tmp_path / "model"), capitals_data(tmp_path / "data")
    common = [*base_overrides(model, data, 3), f"custom_reward_function.path={reward}", "trainer.save_freq=1"]
    cmd = [sys.executable, "-m", "grpo_core.cli", "train", f"trainer.default_local_dir={run_dir}", *common]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=tmp_path)
    deadline = time.monotonic() + 600
    while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().strip()):
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    flag.touch()  # step 2 stops in the reward until the flag goes
    orphans = psutil.Process(first.pid).children(recursive=True)
    first.kill()
    first.wait()
    refused = subprocess.run([*cmd], capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=300)
    assert refused.returncode == 1, refused.stderr[-3000:]
    [error] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "is in use by the torchrun agent or ranks of an earlier run" in error and "--wait" in error, error
    assert any(p.is_running() for p in orphans)
    log = tmp_path / "waiting.err"
    with log.open("w") as err:
        waiting = subprocess.Popen([*cmd[:4], "--wait", *cmd[4:]], stderr=err, env=env(), cwd=tmp_path)
    while "waiting for them to end" not in log.read_text():
        assert waiting.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    flag.unlink()  # the earlier run's ranks finish their step (or are killed by their agent), then end
    assert waiting.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in orphans)
    steps = [m["step"] for m in metrics(run_dir)]
    assert steps == [1, 2, 3], steps  # each step once: never two runs writing


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    run_dir = tmp_path / "run"
    holder = holder_process(run_dir)
    os.kill(holder.pid, signal.SIGKILL)  # no clean-up: its holder file stays, the OS lets go of the lock
    holder.wait(timeout=60)
    assert json.loads((run_dir / HOLDER_FILE).read_text())["pid"] == holder.pid
    acquire(run_dir, flow_run="manual")
    try:
        assert read_holder(run_dir).pid == os.getpid() and read_holder(run_dir).flow_run == "manual"
        assert f"took over run directory {run_dir.resolve()} from host" in caplog.text
        assert f"pid {holder.pid}" in caplog.text and "its process is gone" in caplog.text
    finally:
        release(run_dir)
    assert not (run_dir / HOLDER_FILE).exists()
