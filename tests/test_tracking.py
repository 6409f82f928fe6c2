"""MLflow tracking: a real `mlflow server` on loopback that goes away mid-run, secret masking, plots
(`grpo compare`: tests/test_compare.py)."""

import json
import time

import pytest
from mlflow import MlflowClient

from grpo_core.tracking.mlflow_run import MlflowRun
from grpo_core.tracking.plots import plot_run
from tests.support.servers import free_port, start_mlflow, stop


def test_metrics_logged_while_the_server_is_down_arrive_when_it_returns(tmp_path):
    port = free_port()
    server = start_mlflow(tmp_path / "store", port)
    uri = f"http://127.0.0.1:{port}"
    try:
        run = MlflowRun.create(uri, "outage", "run", pending_file=tmp_path / "pending.jsonl", retry_s=0.5)
        run.log_metrics({"reward/mean": 0.1}, step=1)
        assert run.flush()
        stop(server)

        for step in (2, 3):  # training goes on: each call returns at once, the metrics wait in the queue
            start = time.monotonic()
            run.log_metrics({"reward/mean": 0.1 * step}, step=step)
            assert time.monotonic() - start < 15
        assert not run.flush() and len(run.queue) == 2

        server = start_mlflow(tmp_path / "store", port)  # same store, same port: the server is back
        time.sleep(0.6)
        run.log_metrics({"reward/mean": 0.4}, step=4)
        assert run.close(wait_s=30)
        history = MlflowClient(uri).get_metric_history(run.run_id, "reward/mean")
        assert sorted((m.step, round(m.value, 6)) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
        assert not (tmp_path / "pending.jsonl").exists()

        # Down at the end: what could not be sent is written to the pending file, and said so.
        stop(server)
        run.log_metrics({"reward/mean": 0.5}, step=5)
        assert not run.close(wait_s=1)
        pending = [json.loads(line) for line in (tmp_path / "pending.jsonl").read_text().splitlines()]
        assert pending[0]["run_id"] == run.run_id and pending[0]["args"]["metrics"][0]["step"] == 5
    finally:
        stop(server)


def test_params_with_secret_names_are_masked_and_rejected_calls_do_not_block_the_queue(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = MlflowRun.create(uri, "masking", "run")
    run.log_params({"trainer.env.WANDB_API_KEY": "abc", "trainer.env.HF_TOKEN": "x", "model.tokenizer_path": "t"})
    run.log_params({"model.tokenizer_path": "changed"})  # MLflow refuses to change a param: dropped, not queued
    run.log_metrics({"a": 1.0}, step=1)
    assert run.flush() and not run.queue
    params = MlflowClient(uri).get_run(run.run_id).data.params
    assert params == {"trainer.env.WANDB_API_KEY": "***", "trainer.env.HF_TOKEN": "***", "model.tokenizer_path": "t"}


def test_plots_are_written_for_the_metrics_a_run_has(tmp_path):
    rows = [{"step": s, "reward/mean": 0.1 * s, "perf/throughput": 900.0 + s} for s in (1, 2, 3)]
    written = plot_run(rows, tmp_path, base=0.1, trained=0.2)
    assert [p.name for p in written] == ["reward.png", "throughput.png", "accuracy.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)
    assert [p.name for p in plot_run([{"step": 1, "reward/mean": 0.0}], tmp_path / "only")] == ["reward.png"]


def test_wandb_run_offline_has_the_metrics_file_names_steps_and_masked_config(tmp_path, monkeypatch):
    """trainer.logger=[console,wandb]: project/run names from the trainer section, the flattened config with
    secrets masked, and every metrics.jsonl row under the same names and step."""
    pytest.importorskip("wandb")
    from grpo_core.config import load_config, to_flat_dict
    from grpo_core.tracking import METRICS_FILE, Tracker
    from tests.support.wandb_log import read_run

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network here
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(
        None,
        [
            "trainer.logger=[console,wandb]",
            "trainer.project_name=grpo_wandb_test",
            "trainer.experiment_name=two_steps",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "+trainer.env.WANDB_API_KEY=not-for-logs",
        ],
    )
    tracker = Tracker(cfg)
    tracker.log_params(to_flat_dict(cfg))
    steps = {1: {"reward/mean": 0.25, "actor/kl_loss": 0.001, "timing/step": 3.5}, 2: {"reward/mean": 0.75}}
    for step, metrics in steps.items():
        tracker.log(metrics, step=step)
    tracker.close()

    files = list((tmp_path / "wandb_home").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    run = read_run(files[0])
    assert (run["project"], run["name"]) == ("grpo_wandb_test", "two_steps")
    assert run["config"]["trainer.env"]["WANDB_API_KEY"] == "***"  # a dict setting stays whole, masked inside
    assert run["config"]["trainer.env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert run["config"]["actor_rollout_ref.rollout.n"] == cfg.actor_rollout_ref.rollout.n
    assert run["config"]["trainer.logger"] == ["console", "wandb"]

    written = [json.loads(line) for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    logged = [
        {k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]} for row in run["history"]
    ]
    assert logged == written == [{"step": s, **m} for s, m in steps.items()], (run["history"], written)


def test_secrets_inside_dict_settings_are_masked():
    from grpo_core.tracking.mlflow_run import mask_secrets

    flat = {"trainer.env": {"WANDB_API_KEY": "k", "NCCL_DEBUG": "WARN"}, "x.hf_token": "t", "x.tokens": 3}
    assert mask_secrets(flat) == {
        "trainer.env": {"WANDB_API_KEY": "***", "NCCL_DEBUG": "WARN"},
        "x.hf_token": "***",
        "x.tokens": 3,
    }


def test_step_axes_have_integer_ticks_and_start_where_the_data_does():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo_core.tracking.plots import step_axis

    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [0.0, 0.1, 0.3])
    step_axis(ax, [1, 2, 3])
    assert ax.get_xlim() == (1, 3)
    assert all(float(t).is_integer() for t in ax.get_xticks())
    plt.close(fig)
