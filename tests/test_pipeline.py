"""The pipeline as users run it: `grpo pipeline` on Prefect's ephemeral API, tracked in MLflow.

`make demo` itself where its claim is made (configs/demo_cpu.yaml's sizes on SmolLM2-135M-Instruct, which `make
test` fetches, on a CPU that multiplies bf16 natively): the answer format rises significantly. The other tests: a
tiny random Llama (SmolLM2 tokenizer) on the embedded GSM8K sample, 2 GRPO steps: the numbers are not the point, the
wiring is — every task runs for real (torchrun, gloo), a second run is served from the persisted results, and the
MLflow run has what `grpo compare` and a person need.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpo_core.config.load import load_config
from grpo_core.quiet import MARK
from tests.conftest import REPO
from tests.support.servers import prefect_env
from tests.support.tiny import TOKENIZER, tiny_model_dir
from tests.test_quiet import CHATTER, misleading_lines
from tests.test_secrets import LEAKS, PLANTED, env_overrides


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
        f"tracking.model_cache_dir={root / 'models'}",  # a registry version's local copy (the base, champion)
        "tracking.champion_min_uplift=-1",  # any uplift is enough; promotion then hangs on the paired test alone
    ]


def lineage_on_the_server(client, run, data_dir: Path, files: str = "config.json"):
    """What a run's MLflow page shows of its lineage, checked against the prepare record: both datasets (digest,
    context, where the rows came from), the evaluated checkpoint as a logged model (the run's output at the last
    step, READY, its metrics against the evaluation set, the exported files) and the registry version made from
    it (its source, the training set's digest in its tags). The logged model."""
    from mlflow.entities import LoggedModelStatus
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from grpo_core.data.lineage import dataset_digest, read_record

    digests = read_record(data_dir)["digests"]
    train, test = digests["train.parquet"], digests["test.parquet"]
    assert train == dataset_digest([data_dir / "train.parquet"]) and len(train) == 32
    inputs = {
        next(t.value for t in i.tags if t.key == MLFLOW_DATASET_CONTEXT): i.dataset for i in run.inputs.dataset_inputs
    }
    assert {c: (d.name, d.digest) for c, d in inputs.items()} == {
        "training": ("gsm8k-train", train),
        "evaluation": ("gsm8k-test", test),
    }
    assert json.loads(inputs["training"].profile) == {"num_rows": 256, "num_skipped": 0, "prepared_from": "embedded"}

    experiment, run_id = run.info.experiment_id, run.info.run_id
    (model,) = client.search_logged_models([experiment], filter_string=f"source_run_id = '{run_id}'")
    assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [(model.model_id, 2)]
    assert model.name == "step_000002" and model.status == LoggedModelStatus.READY
    assert model.tags["grpo.train_data_digest"] == train and model.tags["grpo.eval_data_digest"] == test
    metrics = {m.key: m for m in model.metrics}
    assert {"val/accuracy", "eval/trained/accuracy_strict"} <= metrics.keys()
    assert {(m.dataset_name, m.dataset_digest, m.step) for m in metrics.values()} == {("gsm8k-test", test, 2)}
    assert metrics["val/accuracy"].value == run.data.metrics["val/accuracy"]
    assert files in {a.path for a in client.list_logged_model_artifacts(model.model_id)}  # a model's, or an adapter's

    (version,) = client.search_model_versions(f"name = 'pipeline_test' and run_id = '{run_id}'")
    assert version.source == f"models:/{model.model_id}"
    assert version.tags["grpo.train_data_digest"] == train
    listed = [{"name": "pipeline_test", "version": int(version.version)}]
    assert json.loads(model.tags["mlflow.modelVersions"]) == listed
    return model


def grpo(*args: str, env: dict, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    cmd = [sys.executable, "-m", "grpo_core.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)


@contextlib.contextmanager
def processes_with(variable: str) -> Iterator[dict[int, tuple[dict[bytes, bytes], bytes]]]:
    """While the block runs, every process whose environment holds ``variable`` (NAME=VALUE), as
    pid -> (environment, command line), read from /proc every 0.25 s."""
    seen, done, marker = {}, threading.Event(), variable.encode()

    def watch() -> None:
        while not done.wait(0.25):
            for entry in Path("/proc").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    environ = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
                    if marker in environ and (cmdline := (entry / "cmdline").read_bytes()):
                        seen[int(entry.name)] = (dict(v.split(b"=", 1) for v in environ if b"=" in v), cmdline)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()


def leaked(text: bytes | str) -> list[str]:
    """The planted secrets (tests/test_secrets.py) that ``text`` holds."""
    data = text if isinstance(text, bytes) else text.encode()
    return [leak for leak in LEAKS if leak.encode() in data]


def files_leaking(*roots: Path) -> dict[str, list[str]]:
    """File -> the planted secrets it holds, for every file under ``roots`` that holds one."""
    found = {str(f): leaked(f.read_bytes()) for root in roots for f in root.rglob("*") if f.is_file()}
    return {path: leaks for path, leaks in found.items() if leaks}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=1)


LORA = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8"]


def test_pipeline_runs_on_the_ephemeral_api_and_a_rerun_is_served_from_its_results(tmp_path, tiny_model):
    """With LoRA (issue 37): the version registered is the run's PEFT adapter, naming its base; a run from that
    version resolves to the base with the adapters starting from it, and `grpo evaluate` evaluates it merged. (The
    pipeline without LoRA registers the merged model: test_a_tracking_server_down_at_the_start_loses_nothing...)"""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = pipeline_overrides(tmp_path, tiny_model, uri) + LORA
    env = prefect_env(tmp_path / "prefect")
    first = grpo("pipeline", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    assert "MLflow run:" in first.stdout and "Prefect flow run:" in first.stdout
    # Issue 44: a quiet, truthful terminal (none of its noisy lines; the libraries' kept in the run's log), progress in
    # every phase (the ranks' set-up, each evaluation with tokens/s), and what the run wrote and how large.
    terminal = first.stdout + first.stderr
    assert misleading_lines(terminal) == [], terminal[-6000:]
    for phase in ("loading the tokenizer and data of", "building the actor (", "building the static rollout engine"):
        assert f"\nset-up: {phase}" in first.stderr, first.stderr[-5000:]
    assert "\nset-up: ready; step 1 of 2 starts" in first.stderr
    for name in ("base", "trained"):
        assert f"\nevaluate {name}: loading " in first.stderr and " into the static engine, then 4 questions of " in (
            first.stderr
        )
        assert re.search(rf"\nevaluate {name}: 4/4 questions, \d+ tokens in [\d.]+ s \(\d+ tokens/s\)\n", terminal)
    assert "\nnode 0: starting grpo_core.main_ppo on 1 rank(s) of this node (command line and output: " in (terminal)
    assert re.search(r"\ncheckpoint: \S+/step_000002 \(\d+\.\d\d GB: extra, hf_model, model\)\n", first.stdout)
    assert "\ndata: 256 train rows, 128 test rows in " in first.stderr
    library_log = (tmp_path / "run" / "launch" / "pipeline.log").read_text()
    assert "Finished in state Completed()" in library_log and "Creating initial MLflow database tables" in library_log
    assert "grpo_core.launch.agent --nnodes=1" in library_log  # the whole command line (secrets masked)

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
    model = lineage_on_the_server(client, run, tmp_path / "data", "adapter_config.json")  # datasets, model, version
    # the registry: the base model is version 1, the champion from the first run on (issue 44), with its evaluation;
    # a random model gains nothing significant over it: version 2 is the challenger, and says why
    base = client.get_model_version_by_alias("pipeline_test", "champion")
    assert str(base.version) == "1" and base.tags["grpo.base_model"] == str(tiny_model) and base.run_id in (None, "")
    assert base.tags["grpo.eval.questions"] == "4" and "grpo.eval.accuracy_strict" in base.tags
    version = client.get_model_version_by_alias("pipeline_test", "challenger")
    assert str(version.version) == "2" and version.tags["grpo.promotion"] == "challenger"
    tags = version.tags
    assert tags["grpo.compared_with"] == "champion version 1 (the base model)"
    assert "may be noise" in tags["grpo.promotion_reason"] and "the champion stays" in tags["grpo.promotion_reason"]
    assert "promotion: uplift" in first.stdout
    assert tags["grpo.lora.base_model"] == str(tiny_model)  # the adapter's base, for a warm start from it
    # the ephemeral API: where the flow run is kept, and the one command that shows it
    kept = f"kept in {tmp_path / 'prefect' / 'prefect.db'}; to see it and its report: `prefect server start`, then "
    assert kept in first.stdout, first.stdout[-3000:]

    # A second run with the same inputs: every task is served from its persisted result; no new MLflow run.
    train_log = tmp_path / "run" / "launch" / "node0.log"
    before = (train_log.stat().st_mtime_ns, (tmp_path / "run" / "metrics.jsonl").read_text())
    second = grpo("pipeline", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides, env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-5000:]
    cached = ": the result of an earlier run with the same inputs (not run again)"
    assert second.stderr.count(cached) >= 4, second.stderr[-5000:]
    assert misleading_lines(second.stdout + second.stderr) == [], second.stderr[-5000:]
    assert (train_log.stat().st_mtime_ns, (tmp_path / "run" / "metrics.jsonl").read_text()) == before
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    assert len(client.search_model_versions("name = 'pipeline_test'")) == 2  # the re-run found its version
    again = lineage_on_the_server(client, client.get_run(run_id), tmp_path / "data", "adapter_config.json")
    assert again.model_id == model.model_id  # once

    # the adapter version as a start model: its base's weights, the adapters from it; evaluated merged into its base
    start = [f"actor_rollout_ref.model.path=models:/pipeline_test/{version.version}", *LORA]
    dry = grpo("train", "--dry-run", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides, *start, env=env,
               cwd=tmp_path, timeout=300)  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"a LoRA adapter on {tiny_model}: its base ({tiny_model}) with the adapters starting from it" in dry.stdout
    evaluate = ["evaluate", "--model", f"models:/pipeline_test/{version.version}", "--tracking-uri", uri]
    evaluate += ["--data", str(tmp_path / "data" / "test.parquet"), "--limit", "2", "--max-new-tokens", "4"]
    cache = {**env, "GRPO_MODEL_CACHE": str(tmp_path / "models")}
    evaluated = grpo(*evaluate, "--output", str(tmp_path / "eval_v2"), env=cache, cwd=tmp_path, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "eval_v2" / "metrics.json").read_text())["num_questions"] == 2

    compare = grpo("compare", "--tracking-uri", uri, "--experiment", "pipeline_test", env=env, cwd=tmp_path)
    assert compare.returncode == 0 and run_id[:8] in compare.stdout, compare.stdout + compare.stderr


DEMO_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"


def demo_runs_here() -> bool:
    """Whether `make demo` can run as a test: its model is present (`make test` fetches it) and the CPU multiplies
    bf16 natively, the machines its claim (a significant rise within minutes) is measured on. On an AVX2-only CPU
    (float32) it would take ~30 min, and its float32 sampling stream is not the measured one."""
    from grpo_core.config.hardware import cpu_has_bf16_matmul

    return (DEMO_MODEL / "model.safetensors").is_file() and cpu_has_bf16_matmul()


@pytest.mark.skipif(not demo_runs_here(), reason="needs models/SmolLM2-135M-Instruct (make test) and bf16 matmuls")
def test_the_demo_learns_the_answer_format(tmp_path):
    """`make demo` as it runs (the config's sizes and seeds, all cores): its closing lines say the format rate rose
    with p < 0.01 (issue 39), and the trained model is registered. The wiring is the tiny model's test above."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [
        f"actor_rollout_ref.model.path={DEMO_MODEL}",
        f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"tracking.mlflow_tracking_uri={uri}",
        f"tracking.model_cache_dir={tmp_path / 'models'}",
    ]
    cfg = load_config(REPO / "configs/demo_cpu.yaml", overrides)
    env = {**prefect_env(tmp_path / "prefect"), "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}
    result = grpo("pipeline", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides, env=env, cwd=tmp_path,
                  timeout=1800)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    fmt = re.search(r"\n  format rate \(`#### N` answers, eval\): .*, p (<|=) ([\d.]+), .*: (.+)\n", result.stdout)
    assert fmt and fmt[3] == "rose" and float(fmt[2]) < 0.01, result.stdout[-3000:]
    name = cfg.tracking.registered_model_name or cfg.trainer.project_name
    versions = MlflowClient(uri).search_model_versions(f"name = '{name}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]  # the base (champion from the start) and the trained


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


def test_a_prefect_api_that_is_down_is_one_line_in_seconds_before_the_run_directory_is_written(tmp_path):
    """PREFECT_API_URL at a port nothing listens on (issue 42: the flow engine raised a chained RuntimeError): one
    line saying what to do, exit 1, in seconds; the run directory is not written."""
    from tests.support.servers import free_port

    url, run_dir = f"http://127.0.0.1:{free_port()}/api", tmp_path / "run"
    start = time.monotonic()
    result = grpo(
        "pipeline",
        "--config",
        str(REPO / "configs/demo_cpu.yaml"),
        f"trainer.default_local_dir={run_dir}",
        env=prefect_env(tmp_path / "prefect", api_url=url),
        cwd=tmp_path,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: the Prefect API at {url} does not answer (")
    assert error.endswith(
        "unset PREFECT_API_URL to run on Prefect's ephemeral API, or start that server (`prefect server start`)"
    )
    assert elapsed < 60 and not run_dir.exists(), elapsed


def test_a_tracking_server_down_at_the_start_loses_nothing_once_synced(tmp_path, tiny_model):
    """The server is down for the whole pipeline: it trains, evaluates and registers into the pending
    file; `grpo tracking sync` sends it all once the server is up, and a second sync sends nothing.
    Issue 42: trainer.env holds secrets (tests/test_secrets.py's PLANTED); the rank gets them in its environment,
    and neither its command line, the run directory, the MLflow store nor the terminal shows one."""
    from mlflow import MlflowClient

    from tests.support.servers import free_port, start_mlflow, stop

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    overrides = pipeline_overrides(tmp_path, tiny_model, uri) + env_overrides(PLANTED)
    env = prefect_env(tmp_path / "prefect")
    with processes_with(f"MY_PAT={PLANTED['MY_PAT']}") as started:  # torchrun's agent and the rank
        run = grpo("pipeline", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    # the rank (its own children, e.g. torch.compile's C++ compiler, inherit its environment: same user, same secrets)
    ranks = [(e, cmdline) for e, cmdline in started.values() if b"LOCAL_RANK" in e and b"grpo_core.main_ppo" in cmdline]
    assert ranks, started
    assert all(b"+trainer.env.MY_PAT=${oc.env:MY_PAT}" in cmdline for _, cmdline in ranks)  # the name, a reference
    assert all(environ[k.encode()] == v.encode() for environ, _ in ranks for k, v in PLANTED.items())
    assert not [cmdline for _, cmdline in started.values() if leaked(cmdline)]  # what `ps` shows
    assert "Traceback" not in run.stdout + run.stderr
    assert "MLflow run: not sent yet" in run.stdout and "model version: pending" in run.stdout
    # A quiet, informative terminal: the project's first line, a line per step and per evaluation batch, no
    # library chatter (which the ranks' log keeps, marked).
    assert run.stderr.splitlines()[0].startswith("grpo pipeline: pipeline_test / tiny in "), run.stderr[:2000]
    assert "step 1/2: reward " in run.stderr and "step 2/2: reward " in run.stderr and "tokens/s " in run.stderr
    assert "evaluate base: 4/4 questions" in run.stderr and "evaluate trained: 4/4 questions" in run.stderr
    assert not [c for c in CHATTER if c in run.stdout + run.stderr], run.stderr[-5000:]
    node_log = (tmp_path / "run/launch/node0.log").read_text()
    assert f"[default0]:{MARK}UserWarning: Apex is not installed" in node_log
    assert "+trainer.env.HF_TOKEN=${oc.env:HF_TOKEN}" in node_log.splitlines()[0]  # the launched command line
    pending = tmp_path / "run" / "mlflow_pending.jsonl"
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    server = start_mlflow(tmp_path / "store", port)
    try:
        sync = grpo("tracking", "sync", str(tmp_path / "run"), env=env, cwd=tmp_path, timeout=300)
        assert sync.returncode == 0 and "Traceback" not in sync.stderr, sync.stdout + sync.stderr
        assert f"from {pending} to run" in sync.stdout
        client = MlflowClient(uri)
        (remote,) = client.search_runs([client.get_experiment_by_name("pipeline_test").experiment_id])
        run_id = remote.info.run_id
        assert remote.info.status == "FINISHED" and remote.data.params["trainer.total_training_steps"] == "2"
        assert remote.info.run_name == "tiny"
        # every metric the trainer logged during the outage, at its step, once
        names = {k for row in logged for k in row} - {"step"}
        assert {"reward/mean", "perf/throughput", "actor/pg_loss"} <= names
        for name in sorted(names):
            history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
            expected = [(row["step"], row[name]) for row in logged if name in row]
            assert [s for s, _ in history] == [s for s, _ in expected], name
            assert [v for _, v in history] == pytest.approx([v for _, v in expected], nan_ok=True), name
        assert {"val/accuracy_uplift", "eval/trained/num_questions"} <= remote.data.metrics.keys()
        assert {a.path for a in client.list_artifacts(run_id, "plots")} >= {"plots/reward.png"}
        # the figures, saved while the server was away, and the experiment made by the sync: model training
        figures = {a.path for a in client.list_artifacts(run_id, "figures")}
        assert figures == {"figures/reward_and_format_rate.png", "figures/before_after.png"}
        experiment = client.get_experiment_by_name("pipeline_test")
        assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
        assert "**Promotion:** uplift" in remote.data.tags["mlflow.note.content"]
        model = lineage_on_the_server(client, remote, tmp_path / "data")  # made at sync time, as when online
        # registered as the queue said; never promoted without reading the registry's champion
        version = client.get_model_version_by_alias("pipeline_test", "challenger")
        assert version.run_id == run_id and "could not be read" in version.tags["grpo.promotion_reason"]
        # where it came from, on the server: its files' and its checkpoint manifest's digests, on the run too
        for tag in ("grpo.model_sha256", "grpo.checkpoint_manifest_sha256"):
            assert len(version.tags[tag]) == 64 and remote.data.tags[tag] == version.tags[tag], tag

        again = grpo("tracking", "sync", str(tmp_path / "run"), env=env, cwd=tmp_path, timeout=300)
        assert again.returncode == 0 and "nothing to send" in again.stdout, again.stdout + again.stderr
        assert len(client.get_metric_history(run_id, "reward/mean")) == len(logged)
        assert len(client.search_model_versions("name='pipeline_test'")) == 1
        assert lineage_on_the_server(client, client.get_run(run_id), tmp_path / "data").model_id == model.model_id
        # the secrets' names are tracked, their values are nowhere: params, artifacts, pending file, logs, terminal
        assert "'MY_PAT': '***'" in remote.data.params["trainer.env"]
        resolved = client.download_artifacts(run_id, "resolved_config.yaml", str(tmp_path / "dl"))
        assert all(f"{name}: '***'" in Path(resolved).read_text() for name in PLANTED)
        assert files_leaking(tmp_path / "run", tmp_path / "store", tmp_path / "prefect") == {}  # Prefect's db too
        assert leaked(run.stdout + run.stderr + sync.stdout + sync.stderr) == []
    finally:
        stop(server)
