"""Real Prefect and MLflow servers on loopback for tests, started with the commands users run."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start(argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    out = log.open("a")
    return subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
    )


def start_mlflow(store: Path, port: int) -> subprocess.Popen:
    """``mlflow server`` with a SQLite backend and an artifact directory under ``store``."""
    store.mkdir(parents=True, exist_ok=True)
    argv = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    argv += ["--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}", "--artifacts-destination", str(store / "art")]
    proc = start(argv, store / "server.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, store / "server.log")
    except BaseException:  # a server too slow to come up is not left running after the test
        stop(proc)
        raise
    return proc


@contextlib.contextmanager
def mlflow_server(store: Path) -> Iterator[str]:
    port = free_port()
    proc = start_mlflow(store, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def prefect_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    """An isolated Prefect profile: its own home, result storage and (optionally) a server to talk to."""
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[str]:
    """``prefect server start`` on loopback; yields its API URL."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    proc = start(argv, home / "server.log", prefect_env(home))
    try:
        wait_healthy(f"http://127.0.0.1:{port}/api/health", proc, home / "server.log")
        yield f"http://127.0.0.1:{port}/api"
    finally:
        stop(proc)
