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
    wandb = pytest.importorskip("wandb")
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
    # finish() can return before wandb's service has flushed the run file (seen once in CI: the file held no
    # records); teardown waits for the service to exit, as a process's end does.
    wandb.teardown()

    files = list((tmp_path / "wandb_home").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    run = read_run(files[0])
    assert (run["project"], run["name"]) == ("grpo_wandb_test", "two_steps")
    assert run["config"]["trainer.env"]["WANDB_API_KEY"] == "***"  # a dict setting stays whole, masked inside
    assert run["config"]["trainer.env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "***"  # every trainer.env value
    assert run["config"]["actor_rollout_ref.rollout.n"] == cfg.actor_rollout_ref.rollout.n
    assert run["config"]["trainer.logger"] == ["console", "wandb"]

    written = [json.loads(line) for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    logged = [
        {k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]} for row in run["history"]
    ]
    assert logged == written == [{"step": s, **m} for s, m in steps.items()], (run["history"], written)


def test_close_gives_an_outage_its_wait_once_not_again_at_the_end(tmp_path, monkeypatch):
    """A server that went away just now is retried until it has been gone ``wait_s``; one that has been gone
    longer (down for the whole run) gets one last try, and its calls go to the pending file at once."""
    attempts = []

    def refused(method, kwargs):
        attempts.append(method)
        raise ConnectionError("connection refused")

    for age_s, tries in ((0.0, range(3, 20)), (60.0, [2])):  # (the outage's age at close, the calls tried in all)
        attempts.clear()
        pending = tmp_path / f"pending_{age_s:g}.jsonl"
        run = MlflowRun(f"http://127.0.0.1:{free_port()}", "r1", pending_file=pending, retry_s=0.05)
        monkeypatch.setattr(run, "call", refused)
        run.log_metrics({"reward/mean": 0.5}, step=1)  # the first refusal: the outage starts
        run._down_since -= age_s
        assert not run.close(wait_s=0.5)
        assert len(attempts) in tries, (age_s, attempts)
        assert len(pending.read_text().splitlines()) == 1


def test_a_run_deferred_while_the_server_is_down_is_synced_once_from_its_pending_file(tmp_path):
    from grpo_core.tracking.mlflow_run import KEY_TAG
    from grpo_core.tracking.sync import sync_pending

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    pending = tmp_path / "run" / "mlflow_pending.jsonl"
    # The pipeline's run and its trainer's, both made while nothing listens on the port.
    run = MlflowRun.deferred(uri, "outage", "k1", {"mlflow.runName": "tiny"}, pending_file=pending, retry_s=60)
    run.log_params({"trainer.total_training_steps": 2})
    trainer = MlflowRun(uri, run.run_id, pending_file=pending, retry_s=60)
    for step in (1, 2):
        trainer.log_metrics({"reward/mean": 0.25 * step}, step=step)
    assert not trainer.close(wait_s=0)
    (tmp_path / "plot.txt").write_text("a plot")
    run.log_artifact(tmp_path / "plot.txt", "plots")
    run.finish()
    assert not run.close(wait_s=0) and len(pending.read_text().splitlines()) == 6
    down = sync_pending(tmp_path / "run")  # still down: stops at once, nothing counted as sent
    assert not down.complete and down.sent == 0 and "did not take call 1 (log_batch)" in down.error

    server = start_mlflow(tmp_path / "store", port)
    try:
        first = sync_pending(tmp_path / "run")
        assert first.complete and (first.total, first.already, first.sent, first.dropped) == (6, 0, 6, [])
        client = MlflowClient(uri)
        (run_id,) = set(first.run_ids)  # the pipeline's calls and the trainer's land in one run
        remote = client.get_run(run_id)
        assert remote.data.tags[KEY_TAG] == "k1" and remote.data.tags["mlflow.runName"] == "tiny"
        assert remote.data.params == {"trainer.total_training_steps": "2"} and remote.info.status == "FINISHED"
        assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/plot.txt"]
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")]
        assert sorted(history) == [(1, 0.25), (2, 0.5)]

        again = sync_pending(tmp_path / "run")  # idempotent: nothing is sent twice
        assert (again.already, again.sent) == (6, 0)
        assert len(client.get_metric_history(run_id, "reward/mean")) == 2
    finally:
        stop(server)


def test_tracking_sync_of_a_missing_or_damaged_pending_file_is_one_line_and_exit_2(tmp_path, capsys):
    from grpo_core.cli import main

    assert main(["tracking", "sync", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path}/mlflow_pending.jsonl does not exist")
    (tmp_path / "mlflow_pending.jsonl").write_text('{"run_id": "r", "method": "log_batch", "args": {}}\nnot json\n')
    assert main(["tracking", "sync", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}/mlflow_pending.jsonl:2 is not a JSON line") and "Traceback" not in err
    assert not (tmp_path / "mlflow_pending.sent").exists()  # nothing was sent


def test_a_training_run_started_while_the_server_is_down_trains_and_keeps_its_calls(tmp_path, monkeypatch):
    from grpo_core.config.load import load_config
    from grpo_core.tracking import Tracker
    from grpo_core.tracking.mlflow_run import RUN_ID_VAR

    monkeypatch.delenv(RUN_ID_VAR, raising=False)
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    overrides = [f"trainer.default_local_dir={tmp_path}", "trainer.logger=[mlflow]"]
    tracker = Tracker(load_config(None, [*overrides, f"tracking.mlflow_tracking_uri={uri}"]))
    assert tracker._mlflow.is_deferred  # no exception: training goes on
    tracker.log({"reward/mean": 0.5}, step=1)
    tracker._file.close()
    assert not tracker._mlflow.close(wait_s=0)
    records = [json.loads(line) for line in (tmp_path / "mlflow_pending.jsonl").read_text().splitlines()]
    assert {r["run_id"] for r in records} == {tracker._mlflow.run_id}  # one run, found or created by sync
    assert records[-1]["args"]["metrics"][0].items() >= {"key": "reward/mean", "value": 0.5, "step": 1}.items()


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


@pytest.mark.parametrize(("start_step", "kept"), [(0, []), (2, [1, 2])])
def test_metrics_file_holds_this_runs_history(tmp_path, start_step, kept):
    """A run that starts after step s (0: fresh) keeps the file's rows up to s and drops the later ones (an
    earlier run's, or steps its checkpoint does not hold) and a line a kill left half-written."""
    from grpo_core.config import load_config
    from grpo_core.tracking import METRICS_FILE, Tracker

    run = tmp_path / "run"
    run.mkdir()
    old = "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in (1, 2, 3))
    (run / METRICS_FILE).write_text(old + '{"step": 4, "rew')
    cfg = load_config(None, [f"trainer.default_local_dir={run}", "trainer.logger=[console]"])
    tracker = Tracker(cfg, start_step=start_step)
    tracker.log({"reward/mean": 0.5}, step=start_step + 1)
    tracker.close()
    rows = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [*kept, start_step + 1]
    assert rows[-1]["reward/mean"] == 0.5


def test_training_rows_merge_the_rows_of_a_step(tmp_path):
    """A resumed run validates at its first step, a row beside that step's saved metrics: both survive."""
    from grpo_core.pipeline.summary import training_rows
    from grpo_core.tracking import METRICS_FILE

    rows = [{"step": 2, "reward/mean": 0.5}, {"step": 2, "val/accuracy": 0.25}, {"step": 1, "reward/mean": 0.1}]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert training_rows(tmp_path) == [
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.5, "val/accuracy": 0.25},
    ]
