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
from grpo_core.pipeline.summary import HEADLINE_METRICS
from grpo_core.tracking.registry import fetch_model
from tests.conftest import REPO
from tests.support.servers import mlflow_server, prefect_env, prefect_server
from tests.support.tiny import TOKENIZER, tiny_model_dir
from tests.test_notify import flow_run_artifacts
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
        config.write_text(to_yaml(cfg, mask_secrets=False))  # a config to run: its values as they are
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
        run_id, metrics = run.info.run_id, run.data.metrics

        # Issue 44: MLflow's model-training view with the results in front: the experiment's kind, the report as
        # the run's description, the headline numbers as metrics and the figures.
        experiment = client.get_experiment_by_name("pipeline_test")
        assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
        assert set(HEADLINE_METRICS) <= metrics.keys()
        assert metrics["uplift"] == pytest.approx(metrics["val/accuracy_uplift"])
        assert metrics["tokens_per_s_per_gpu"] == pytest.approx(metrics["perf/throughput_mean"])
        note = run.data.tags["mlflow.note.content"]
        uplift = f"**{metrics['uplift']:+.4f}** [{metrics['uplift_ci95_low']:+.4f}, {metrics['uplift_ci95_high']:+.4f}]"
        assert uplift in note and "**Promotion:** uplift" in note and "| training data digest | `" in note
        figures = {a.path for a in client.list_artifacts(run_id, "figures")}
        assert figures == {"figures/reward_and_format_rate.png", "figures/before_after.png"}
        # a champion from the first run: the base model, version 1, with its evaluation; the trained model is
        # version 2, the challenger (no significant gain over it)
        base = client.get_model_version_by_alias("pipeline_test", "champion")
        assert str(base.version) == "1" and base.tags["grpo.base_model"] == str(model)
        assert "grpo.checkpoint_manifest_sha256" not in base.tags and "grpo.eval.accuracy_strict" in base.tags
        trained = client.get_model_version_by_alias("pipeline_test", "challenger")
        assert str(trained.version) == "2" and trained.run_id == run_id
        assert trained.tags["grpo.compared_with"] == "champion version 1 (the base model)"
        # a warm start from models:/NAME@champion reads the base version's files, checked against its digest
        champion = fetch_model("models:/pipeline_test@champion", mlflow_uri, str(tmp_path / "cache"))
        assert champion.canonical == "models:/pipeline_test/1" and champion.tags["grpo.base_model"] == str(model)
        assert (champion.path / "config.json").read_text() == (model / "config.json").read_text()
        (champion.path / "config.json").write_text("{}")  # changed in the cache: downloaded again, as any version's
        again = fetch_model("models:/pipeline_test@champion", mlflow_uri, str(tmp_path / "cache"))
        assert (again.path / "config.json").read_text() == (model / "config.json").read_text()

        # Issue 38: the flow run's report (markdown) and the prepare and evaluate tasks' tables, through Prefect's
        # client
        _, artifacts = flow_run_artifacts(api, flow_run_id)
        (report,) = [a for a in artifacts if a.type == "markdown"]
        assert report.key == "grpo-pipeline-report" and report.data == note  # the same text as the description
        run_page = f"{mlflow_uri}/#/experiments/{experiment.experiment_id}/runs/{run_id}?workflowType=machine_learning"
        assert f"[{run_id}]({run_page})" in report.data
        assert f"[2]({mlflow_uri}/#/models/pipeline_test/versions/2)" in report.data
        tables = {}
        for artifact in artifacts:
            if artifact.type == "table":
                rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
                tables.setdefault(artifact.key, []).append(rows)
        assert sorted(tables) == ["grpo-data", "grpo-evaluation"] and len(tables["grpo-evaluation"]) == 2
        (data,) = tables["grpo-data"]
        assert {(r["split"], r["rows"], len(r["digest"])) for r in data} == {("train", 256, 32), ("test", 128, 32)}
        measures = {r["measure"]: r["value"] for table in tables["grpo-evaluation"] for r in table}
        assert {"accuracy_strict", "num_questions", "tokens_per_s"} <= measures.keys()


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_nightly_trains_from_the_champion_and_a_second_run_with_nothing_new_trains_nothing(tmp_path):
    """The nightly deployment twice: the first trains from models:/NAME@champion (its first step's log-probs
    are the champion's: the same as training from the champion's own directory), the second has the same
    start version, data and config, so it trains nothing, says which inputs are the same, and ends in seconds.
    Issue 38: the champion records the rows its training drew (all but 6 of the training set), so the first run
    draws those 6 first; the version it registers records the data that trained it and the questions that
    judged it (the champion records none: the comparison says so)."""
    from mlflow import MlflowClient

    from grpo_core.data.gsm8k import prepare_gsm8k
    from grpo_core.data.lineage import dataset_digest
    from grpo_core.data.prompts import SEEN_FILE, load_rows, row_id
    from tests.test_registry import register

    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    base = tiny_model_dir(tmp_path / "base", seed=1)
    champion = tiny_model_dir(tmp_path / "champion", seed=2)
    prepare_gsm8k("embedded", tmp_path / "seen", progress=False)  # the training set the pipeline prepares
    rows = load_rows(tmp_path / "seen" / "train.parquet")
    ids = [row_id(row["prompt"], row["reward_model"]["ground_truth"]) for row in rows]
    shortest = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt"][0]["content"]))[:6]
    new = {ids[i] for i in shortest}  # new to the champion (short: none is dropped as overlong)
    (champion / SEEN_FILE).write_text(json.dumps({"rows_seen": sorted(set(ids) - new)}))
    with mlflow_server(tmp_path / "mlflow") as mlflow_uri, prefect_server(tmp_path / "prefect") as api:
        client = MlflowClient(mlflow_uri)
        assert register(client, champion, "pipeline_test", "champion") == "1"
        config = tmp_path / "nightly.yaml"
        overrides = pipeline_overrides(tmp_path, base, mlflow_uri) + [f"tracking.model_cache_dir={tmp_path / 'cache'}"]
        config.write_text(to_yaml(load_config(REPO / "configs/demo_cpu.yaml", overrides), mask_secrets=False))
        env = prefect_env(tmp_path / "prefect", api)
        assert prefect("work-pool", "create", "grpo-process", "--type", "process", env=env).returncode == 0
        deployed = prefect("--no-prompt", "deploy", "--all", env=env)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr

        def nightly() -> tuple[dict, str]:
            name = "grpo-pipeline/nightly-retrain"
            started = prefect("deployment", "run", name, "--param", f"config={config}", env=env)
            assert started.returncode == 0, started.stdout + started.stderr
            flow_run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", started.stdout).group(1)
            worker = prefect("worker", "start", "--pool", "grpo-process", "--run-once", env=env, timeout=1200)
            with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}") as response:
                flow_run = json.load(response)
            assert flow_run["state"]["type"] == "COMPLETED", worker.stdout[-5000:] + worker.stderr[-5000:]
            return flow_run, worker.stdout + worker.stderr

        first, logs = nightly()
        assert "training: there is no finished scheduled run to compare with" in logs, logs[-5000:]
        (run,) = client.search_runs([client.get_experiment_by_name("pipeline_test").experiment_id])
        assert run.data.tags["grpo.start_model"] == "models:/pipeline_test/1"
        assert run.data.tags["grpo.scheduled"] == "true"
        (run_dir,) = (tmp_path / "run").iterdir()  # fresh: a directory named by the scheduled start
        trained_first_step = metrics_rows(run_dir)[0]
        # compared with the champion it started from: not significantly better, so the alias stays
        assert run.data.tags["grpo.promotion"] == "challenger"
        assert run.data.tags["grpo.compared_with"] == "champion version 1"
        assert str(client.get_model_version_by_alias("pipeline_test", "champion").version) == "1"
        # new data first: 2 steps of 4 prompts drew the 6 rows new to the champion (then 2 it had seen), and the
        # export lists every row drawn, its start model's included
        train_digest, test_sha256 = (dataset_digest([tmp_path / "data" / f"{s}.parquet"]) for s in ("train", "test"))
        recorded = json.loads((run_dir / "checkpoints" / "step_000002" / "hf" / SEEN_FILE).read_text())
        assert set(recorded["rows_seen"]) == set(ids) and recorded["train_digest"] == train_digest
        # the version records the data that trained it and the questions that judged it
        tags = client.get_model_version("pipeline_test", "2").tags
        assert (tags["grpo.train_data_digest"], tags["grpo.train.rows_seen"]) == (train_digest, str(len(ids)))
        assert (tags["grpo.eval_data_digest"], tags["grpo.eval.questions"]) == (test_sha256, "4")
        assert tags["grpo.promotion_reason"].startswith(
            "champion version 1 records no evaluation set; it was evaluated on this one (4 questions): uplift "
        )
        assert run.data.tags["grpo.inputs.data_digest"] == train_digest

        second, logs = nightly()  # which inputs are the same, each named, in the flow's log
        same = f"nothing to train: the training data (digest {train_digest[:12]}), the resolved config ("
        last = (
            f"start model (models:/pipeline_test/1) are those of the last scheduled run (MLflow run {run.info.run_id})"
        )
        assert same in logs and last in logs, logs[-5000:]
        assert second["total_run_time"] < 60, second["total_run_time"]
        assert len(client.search_runs([client.get_experiment_by_name("pipeline_test").experiment_id])) == 1
        assert [p.name for p in (tmp_path / "run").iterdir()] == [run_dir.name]

    # The same first step trained from the champion's own directory: the same log-probs, so the same numbers.
    reference = tmp_path / "reference"
    ref_overrides = [f"actor_rollout_ref.model.path={champion}", f"trainer.default_local_dir={reference}"]
    ref_overrides += ["trainer.total_training_steps=1"]
    trained = subprocess.run(
        [sys.executable, "-m", "grpo_core.cli", "train", "--config", str(config), *ref_overrides],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
        timeout=900,
    )
    assert trained.returncode == 0, trained.stderr[-5000:]
    expected = metrics_rows(reference)[0]
    for key in ("actor/entropy_before_update", "rollout/log_prob_diff_mean", "reward/mean"):
        assert trained_first_step[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
