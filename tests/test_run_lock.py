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

import pytest

from grpo_core.launch.run_lock import HOLDER_FILE, acquire, read_holder, release
from tests.conftest import REPO
from tests.support.servers import prefect_env
from tests.support.tiny import TOKENIZER, tiny_model_dir

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


def test_train_with_wait_waits_for_the_holder_then_goes_on(tmp_path, tiny_model):
    run_dir, log = tmp_path / "run", tmp_path / "train.err"
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
    # past the lock: the next check (no data prepared) stops it
    assert waiting.returncode == 2 and "do not exist; write them with `grpo prepare`" in log.read_text()


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
