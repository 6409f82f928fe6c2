"""The pipeline as a deployment: a real `prefect server`, `prefect deploy` of prefect.yaml, `prefect deployment
run`, a real process worker that executes it, and a real `mlflow server` the run lands in (all on loopback)."""

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from grpo_core.config.load import load_config, to_yaml
from tests.conftest import REPO
from tests.support.servers import mlflow_server, prefect_env, prefect_server
from tests.support.tiny import TOKENIZER, tiny_model_dir
from tests.test_pipeline import pipeline_overrides

PREFECT = str(Path(sys.executable).parent / "prefect")


def prefect(*args: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PWD": str(REPO), **env}
    return subprocess.run([PREFECT, *args], capture_output=True, text=True, env=full_env, cwd=REPO, timeout=timeout)


def test_deploy_run_by_a_worker_lands_in_the_mlflow_server(tmp_path):
    from mlflow import MlflowClient

    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    model = tiny_model_dir(tmp_path / "model", seed=1)
    with mlflow_server(tmp_path / "mlflow") as mlflow_uri, prefect_server(tmp_path / "prefect") as api:
        # One config file (a resolved copy of the demo with test sizes) is the deployment's parameter.
        config = tmp_path / "pipeline.yaml"
        cfg = load_config(REPO / "configs/demo_cpu.yaml", pipeline_overrides(tmp_path, model, mlflow_uri))
        config.write_text(to_yaml(cfg))
        env = prefect_env(tmp_path / "prefect", api)

        created = prefect("work-pool", "create", "grpo-process", "--type", "process", env=env)
        assert created.returncode == 0, created.stdout + created.stderr
        deployed = prefect("--no-prompt", "deploy", "--all", env=env)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "grpo-pipeline/on-demand" in deployed.stdout and "grpo-pipeline/nightly-retrain" in deployed.stdout

        started = prefect("deployment", "run", "grpo-pipeline/on-demand", "--param", f"config={config}", env=env)
        assert started.returncode == 0, started.stdout + started.stderr
        flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", started.stdout).group(1)

        worker = prefect("worker", "start", "--pool", "grpo-process", "--run-once", env=env, timeout=1200)
        assert worker.returncode == 0, worker.stdout[-3000:] + worker.stderr[-5000:]
        with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}") as response:
            state = json.load(response)["state"]
        assert state["type"] == "COMPLETED", (state, worker.stdout[-5000:])

        schedules = prefect("deployment", "inspect", "grpo-pipeline/nightly-retrain", env=env).stdout
        assert "0 2 * * *" in schedules

        client = MlflowClient(mlflow_uri)
        (run,) = client.search_runs([client.get_experiment_by_name("pipeline_test").experiment_id])
        assert run.info.status == "FINISHED"
        assert run.data.tags["prefect.flow_run_id"] == flow_run_id
        assert {
            "val/accuracy_baseline",
            "val/accuracy",
            "val/accuracy_uplift",
            "perf/throughput",
        } <= run.data.metrics.keys()
        assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]
