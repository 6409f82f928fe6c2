"""The pipeline as users run it: `grpo pipeline` on Prefect's ephemeral API, tracked in MLflow.

A tiny random Llama (SmolLM2 tokenizer) on the embedded GSM8K sample, 2 GRPO steps: the numbers are not
the point, the wiring is — every task runs for real (torchrun, gloo), a second run is served from the
persisted results, and the MLflow run has what `grpo compare` and a person need.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.servers import prefect_env
from tests.support.tiny import TOKENIZER, tiny_model_dir


def pipeline_overrides(root: Path, model: Path, tracking_uri: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}",
        "data.source=embedded",
        f"data.train_files=[{root / 'data' / 'train.parquet'}]",
        f"data.val_files=[{root / 'data' / 'test.parquet'}]",
        "data.max_response_length=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={root / 'run'}",
        "trainer.project_name=pipeline_test",
        "trainer.experiment_name=tiny",
        "evaluation.limit=4",
        "evaluation.max_new_tokens=8",
        "evaluation.batch_size=8",
        f"tracking.mlflow_tracking_uri={tracking_uri}",
        "tracking.champion_min_uplift=-1",  # a random model's uplift is 0: make it champion to test the alias
    ]


def grpo(*args: str, env: dict, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    cmd = [sys.executable, "-m", "grpo_core.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=1)


def test_pipeline_runs_on_the_ephemeral_api_and_a_rerun_is_served_from_its_results(tmp_path, tiny_model):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = pipeline_overrides(tmp_path, tiny_model, uri)
    env = prefect_env(tmp_path / "prefect")
    first = grpo("pipeline", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    assert "MLflow run:" in first.stdout and "Prefect flow run:" in first.stdout

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("pipeline_test")
    (run,) = client.search_runs([experiment.experiment_id])
    run_id, data = run.info.run_id, run.data
    assert run.info.status == "FINISHED"
    # params: the whole resolved config, flattened
    assert data.params["algorithm.adv_estimator"] == "grpo"
    assert data.params["trainer.total_training_steps"] == "2"
    assert len(data.params) > 100
    # per-step metrics from the trainer (rank 0) and the pipeline's results
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2]
    assert len(client.get_metric_history(run_id, "perf/throughput")) == 2
    m = data.metrics
    assert m["val/accuracy_uplift"] == pytest.approx(m["val/accuracy"] - m["val/accuracy_baseline"])
    assert m["eval/base/num_questions"] == 4
    # artifacts: resolved config, plots, per-sample eval records, the model
    artifacts = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert artifacts == {"plots/reward.png", "plots/throughput.png", "plots/accuracy.png", "plots/curves.png"}
    samples = client.download_artifacts(run_id, "eval/trained/samples.jsonl", str(tmp_path / "dl"))
    records = [json.loads(line) for line in Path(samples).read_text().splitlines()]
    assert len(records) == 4 and {"question", "response", "gold", "correct_strict"} <= records[0].keys()
    assert "model/config.json" in {a.path for a in client.list_artifacts(run_id, "model")}
    # the registry: version 1, aliased champion (threshold -1 above)
    assert str(client.get_model_version_by_alias("pipeline_test", "champion").version) == "1"

    # A second run with the same inputs: every task is served from its persisted result; no new MLflow run.
    train_log = tmp_path / "run" / "launch" / "node0.log"
    before = (train_log.stat().st_mtime_ns, (tmp_path / "run" / "metrics.jsonl").read_text())
    second = grpo("pipeline", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides, env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-5000:]
    assert second.stderr.count("Cached(type=COMPLETED)") >= 4, second.stderr[-5000:]
    assert (train_log.stat().st_mtime_ns, (tmp_path / "run" / "metrics.jsonl").read_text()) == before
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]

    compare = grpo("compare", "--tracking-uri", uri, "--experiment", "pipeline_test", env=env, cwd=tmp_path)
    assert compare.returncode == 0 and run_id[:8] in compare.stdout, compare.stdout + compare.stderr


def test_a_bad_config_fails_before_prefect_starts(tmp_path):
    result = grpo(
        "pipeline",
        "--config",
        str(REPO / "configs/demo_cpu.yaml"),
        "data.train_batch_sise=4",
        env=prefect_env(tmp_path),
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert "data.train_batch_sise" in result.stderr and "Traceback" not in result.stderr
