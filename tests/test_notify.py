"""The regression notice (issue 38 item 7) and a failed flow run's report: a small HTTP server on loopback records
what the pipeline posts; Prefect's client reads the flow run's artifacts from a real `prefect server`."""

import contextlib
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpo_core.pipeline.notices import regression
from grpo_core.pipeline.report import failure_report, flow_run_where, pipeline_report
from grpo_core.tracking.notify import send_notice, target_problems
from tests.conftest import REPO
from tests.support.servers import prefect_env, prefect_server
from tests.support.tiny import TOKENIZER, tiny_model_dir
from tests.test_pipeline import grpo

TOKEN = "T0ken-in-the-path-9f8e7d"  # a webhook URL's path is often its secret
TRACEBACK = "Traceback (most recent call last)"


@contextlib.contextmanager
def recorder() -> Iterator[tuple[str, list[dict]]]:
    """An HTTP server on loopback that answers 200 and records each request (method, path, JSON body)."""
    requests: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802  (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            requests.append({"method": "POST", "path": self.path, "body": json.loads(body or b"null")})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook/{TOKEN}", requests
    finally:
        server.shutdown()
        server.server_close()


SUMMARY = {
    "accuracy_baseline": 0.40,
    "accuracy": 0.30,
    "accuracy_uplift": -0.10,
    "uplift_ci95": (-0.16, -0.04),
    "uplift_p_value": 0.002,
    "questions": 200,
    "throughput": 812.5,
    "step_seconds": 4.2,
    "steps": 50,
    "checkpoint": "/runs/x/checkpoints/step_000050",
    "model_version": "7",
    "promotion": "challenger",
    "promotion_reason": "uplift -0.1000 [-0.1600, -0.0400] over champion version 6 on 200 questions, p = 0.002; "
    "not above the minimum +0.0000: registered as challenger, the champion stays",
    "mlflow_run_id": "abc123",
    "mlflow_url": "http://mlflow.example/#/experiments/1/runs/abc123",
    "format_rate": (0.9, 0.8),
    "data_digests": {"training": "d" * 32, "evaluation": "e" * 32},
    "model_version_url": "http://mlflow.example/#/models/gsm8k/versions/7",
    "compared_with": "champion version 6",
    "compared_uplift": -0.10,
    "compared_p_value": 0.002,
}


def test_a_regression_is_worse_than_the_champion_with_p_below_alpha():
    assert regression(SUMMARY, 0.05) == (
        "the challenger is worse than champion version 6: uplift -0.1000, p = 0.002 < 0.05"
    )
    assert regression({**SUMMARY, "compared_p_value": 0.2}, 0.05) is None  # may be noise
    assert regression({**SUMMARY, "compared_uplift": 0.1}, 0.05) is None  # better
    assert regression({**SUMMARY, "compared_with": "the base model"}, 0.05) is None  # no champion to regress from
    assert regression({**SUMMARY, "compared_with": ""}, 0.05) is None  # not registered


def test_the_report_names_the_uplift_promotion_data_and_links():
    report = pipeline_report(SUMMARY, "gsm8k / nightly")
    assert "| 0.4000 | 0.3000 | **-0.1000** [-0.1600, +0.0400]" not in report  # the interval's signs are kept
    assert "| 0.4000 | 0.3000 | **-0.1000** [-0.1600, -0.0400], p = 0.002 (exact McNemar) |" in report
    assert "| format rate (`#### N` answers) | 0.9000 | 0.8000 | -0.1000 |" in report
    assert "**Promotion:** uplift -0.1000" in report and "| model version | 7 (challenger) |" in report
    assert f"| training data digest | `{'d' * 32}` |" in report and "812.5 tokens/s per GPU" in report
    assert "[abc123](http://mlflow.example/#/experiments/1/runs/abc123)" in report
    assert "[7](http://mlflow.example/#/models/gsm8k/versions/7)" in report
    failed = failure_report("gsm8k / nightly", "train", "node 0: hang: ...", "http://m/ run abc")
    assert "**Failed in:** train" in failed and "**Reason:** node 0: hang: ..." in failed


def test_the_notice_is_one_post_naming_the_run_the_decision_and_why():
    with recorder() as (url, requests):
        subject = f"GRPO pipeline gsm8k / nightly: flow run clever-fox: regression, {regression(SUMMARY, 0.05)}"
        assert send_notice(subject, f"{subject}\n\n{pipeline_report(SUMMARY, 'gsm8k / nightly')}", url=url) == 1
    ((request),) = requests
    assert request["method"] == "POST" and request["path"] == f"/hook/{TOKEN}"
    text = request["body"]["text"]
    assert request["body"]["subject"] == subject and text.startswith(subject)
    assert "clever-fox" in text and "worse than champion version 6" in text and "p = 0.002 < 0.05" in text


def test_a_notice_that_cannot_be_sent_is_a_warning_without_the_url(caplog):
    from tests.support.servers import free_port

    url = f"http://127.0.0.1:{free_port()}/hook/{TOKEN}"  # nothing listens
    assert send_notice("s", "b", url=url) == 0
    assert "was not sent to tracking.notify_webhook_url (ConnectError)" in caplog.text and TOKEN not in caplog.text


def test_bad_targets_are_config_errors_that_never_show_the_url():
    assert target_problems("https://hooks.example/x", "slack-webhook/ml-alerts") == []
    (url_problem, block_problem) = target_problems(f"hooks.example/{TOKEN}", "ml alerts")
    assert (
        url_problem.startswith("tracking.notify_webhook_url: not an http:// or https:// URL")
        and TOKEN not in url_problem
    )
    assert "write a Prefect block as TYPE/NAME" in block_problem


UNPARSABLE = ("http://[hooks.example/{}", "https://hooks.example:99999/{}", "https://h:port/{}", "http://\u2100.io/{}")
"""Webhook URLs Python's URL parser refuses (an unclosed IPv6 bracket, a port out of range or not a number, a host
that NFKC normalization changes): each raised ValueError in the dry run."""


def test_an_unparsable_webhook_url_is_one_line_at_the_dry_run_and_a_warning_at_send_time(capsys, caplog):
    """Issue 53: exit 2 and one line naming the setting, never the URL (its path is the token), at `--dry-run`;
    sent anyway (a deployment's run is not dry-run first), it is a warning, never a traceback."""
    from grpo_core.cli import main

    base = str(REPO / "configs" / "grpo_base.yaml")
    for url in (u.format(TOKEN) for u in UNPARSABLE):
        assert main(["train", "--config", base, f"tracking.notify_webhook_url={url}", "--dry-run"]) == 2, url
        out, err = capsys.readouterr()
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            "error: tracking.notify_webhook_url: not a URL: its host or port cannot be parsed (the value is not "
            "shown: a webhook URL may hold a token)"
        ], err
        assert "Traceback" not in out + err and TOKEN not in out + err and "hooks.example" not in out + err
        caplog.clear()
        assert send_notice("s", "b", url=url) == 0
        assert "the pipeline's notice was not sent to tracking.notify_webhook_url (" in caplog.text, url
        assert TOKEN not in caplog.text and "Traceback" not in caplog.text


def test_where_a_flow_run_is_kept():
    assert flow_run_where("f1", "http://127.0.0.1:4200/runs/flow-run/f1", None) == (
        "http://127.0.0.1:4200/runs/flow-run/f1"
    )
    ephemeral = flow_run_where("f1", None, "sqlite+aiosqlite:////home/u/.prefect/prefect.db")
    assert ephemeral == (
        "f1, kept in /home/u/.prefect/prefect.db; to see it and its report: `prefect server start`, then "
        "http://127.0.0.1:4200/runs/flow-run/f1"
    )


def flow_run_artifacts(api: str, flow_run_id: str | None = None) -> tuple[str, list]:
    """(flow run id, its artifacts) through Prefect's client; without an id, the server's only flow run's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        if flow_run_id is None:
            (flow_run,) = client.read_flow_runs()
            flow_run_id = str(flow_run.id)
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        return flow_run_id, found


def test_a_failed_run_is_one_line_sends_one_notice_and_its_report_says_where_it_failed(tmp_path):
    """A pipeline run whose data cannot be read fails in `prepare`: its markdown artifact (read with Prefect's
    client) says where and why, one notice goes to the configured webhook, and the URL's token is in neither the
    terminal, the flow run's stored parameters nor the run directory.
    Issue 53: the terminal says the failure in one line, naming the phase, the reason and the run's log, exit 2 (the
    input is bad); Prefect's traceback and its "Finished in state Failed" lines are in that log and in the flow run's
    logs in Prefect, not on the terminal; datasets' own error record, which the line says again, is in the log only."""
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    model = tiny_model_dir(tmp_path / "model", seed=1)
    bad = tmp_path / "bad"
    bad.mkdir()
    for split in ("train", "test"):
        (bad / f"{split}.parquet").write_text("not parquet")
    with recorder() as (url, requests), prefect_server(tmp_path / "prefect") as api:
        overrides = [
            f"actor_rollout_ref.model.path={model}",
            f"data.source={bad}",
            f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"tracking.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"tracking.notify_webhook_url={url}",
        ]
        env = prefect_env(tmp_path / "prefect", api)
        run = grpo("pipeline", "--config", str(REPO / "configs/demo_cpu.yaml"), *overrides, env=env, cwd=tmp_path)
        assert run.returncode == 2, run.stderr[-5000:]
        flow_run_id, artifacts = flow_run_artifacts(api)
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(flow_run_id)
            only_this_run, deadline = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), time.time() + 30
            while not (failed := [e.message for e in client.read_logs(only_this_run) if TRACEBACK in e.message]):
                assert time.time() < deadline, client.read_logs(only_this_run)  # the server stores logs in batches
                time.sleep(0.5)
    log = tmp_path / "run" / "launch" / "pipeline.log"
    [error] = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert error == run.stderr.splitlines()[-1], run.stderr[-5000:]
    assert error.startswith(f"error: pipeline failed in prepare (the data): {bad / 'train.parquet'} is not valid")
    assert error.endswith(f" (details in {log})") and TRACEBACK not in run.stdout + run.stderr, run.stderr[-5000:]
    assert "Failed to read schema" not in run.stderr  # datasets' error record, which the line says again
    logged = log.read_text()  # the flow's traceback, chained to pyarrow's, as in the flow run's logs in Prefect
    assert "Encountered exception during execution" in failed[0] and "Encountered exception during execution" in logged
    assert logged.count(TRACEBACK) == 2 and "grpo_core.data.gsm8k.DataError: " in logged
    assert "Failed to read schema" in logged and "Finished in state Failed(" in logged
    assert flow_run.state.is_failed()
    (report,) = [a for a in artifacts if a.key == "grpo-pipeline-report"]
    assert report.type == "markdown" and "**Failed in:** prepare (the data)" in report.data
    assert f"**Reason:** {bad / 'train.parquet'} is not valid Parquet" in report.data
    ((request),) = requests  # one notice, naming the run, the decision (failed) and why
    text = request["body"]["text"]
    assert request["path"] == f"/hook/{TOKEN}"
    assert f"flow run {flow_run.name} failed in prepare (the data)" in text and "is not valid Parquet" in text
    assert TOKEN not in run.stdout + run.stderr
    assert TOKEN not in json.dumps(flow_run.parameters)  # Prefect keeps a reference to the variable instead
    assert not [p for p in Path(tmp_path / "run").rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]


def test_a_bad_webhook_url_is_one_line_and_exit_2_without_the_url(tmp_path):
    result = grpo(
        "pipeline",
        "--config",
        str(REPO / "configs/demo_cpu.yaml"),
        f"tracking.notify_webhook_url=hooks.example/{TOKEN}",
        env=prefect_env(tmp_path),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "notify_webhook_url" in line]
    assert len(errors) == 1 and "not an http:// or https:// URL" in errors[0], result.stderr
    assert TOKEN not in result.stdout + result.stderr
