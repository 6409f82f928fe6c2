"""`grpo compare` against a real `mlflow server` on loopback: two runs that differ in kl_loss_coef, read as a
new user would (piped, 80 columns), in every format, and their curves overlaid in a PNG."""

import csv
import io
import json
import os
import subprocess
import sys

import pytest

from grpo_core.cli import main
from grpo_core.tracking.compare import compare_runs
from grpo_core.tracking.mlflow_run import MlflowRun
from tests.conftest import REPO
from tests.support.servers import mlflow_server

KL = "actor_rollout_ref.actor.kl_loss_coef"
MINUS = "\N{MINUS SIGN}"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two finished pipeline-like runs: the first champion over the base model, the second a challenger."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        ids = []
        for kl, uplift, promotion, against in (
            ("0.001", (0.031, -0.012, 0.074, 0.17), "champion", "the base model"),
            ("0.01", (-0.004, -0.03, 0.022, 0.81), "challenger", "champion version 1"),
        ):
            run = MlflowRun.create(uri, "cmp", "smollm2_135m_cpu", tags={"grpo.promotion": promotion})
            run.set_tags({"grpo.compared_with": against})
            run.log_params({KL: kl, "algorithm.adv_estimator": "grpo", "trainer.default_local_dir": f"ck/{kl}"})
            for step in (1, 2, 3):
                run.log_metrics({"reward/mean": 0.1 * step + float(kl)}, step=step)
            d, low, high, p = uplift
            results = {"val/accuracy_baseline": 0.25, "val/accuracy": 0.25 + d, "val/accuracy_uplift": d}
            results |= {"val/accuracy_uplift_ci95_low": low, "val/accuracy_uplift_ci95_high": high}
            results |= {"val/accuracy_uplift_p_value": p, "eval/base/num_questions": 1319.0}
            run.log_metrics({**results, "perf/throughput_mean": 812.3, "timing/step_mean": 41.2}, step=3)
            run.finish()
            assert run.close()
            ids.append(run.run_id)
        yield uri, ids


def test_only_the_differing_key_and_the_results(two_runs):
    uri, (first, second) = two_runs
    comparison = compare_runs(uri, "cmp")
    assert comparison.differing == [KL]  # not adv_estimator (same), not default_local_dir (ignored)
    assert [r.run_id for r in comparison.runs] == [second, first]  # newest first
    rows = dict(comparison.rows())
    assert rows[KL] == ["0.01", "0.001"]
    assert rows["uplift"][1] == f"+0.031 [{MINUS}0.012, +0.074], p = 0.17, 1,319 questions"
    assert rows["promotion"] == ["challenger (vs champion version 1)", "champion (vs the base model)"]
    assert rows["base accuracy"][0] == "0.250 [0.228, 0.274]"  # Wilson, 330 of 1,319


def test_piped_table_fits_80_columns_and_names_runs_and_key_in_full(two_runs):
    uri, (first, second) = two_runs
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": ""}
    cmd = [sys.executable, "-m", "grpo_core.cli", "compare", "--tracking-uri", uri, "--experiment", "cmp"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if first[:8] in line)
    assert second[:8] in header  # both runs side by side, ids whole
    kl_line = next(line for line in lines if KL in line)
    assert kl_line.split() == [KL, "0.01", "0.001"]
    assert f"+0.031 [{MINUS}0.012," in done.stdout and "champion (vs the" in done.stdout


def test_markdown_csv_and_json(two_runs, capsys):
    uri, (first, second) = two_runs
    base = ["compare", "--tracking-uri", uri, "--experiment", "cmp", "--format"]
    assert main([*base, "markdown"]) == 0
    markdown = capsys.readouterr().out.splitlines()
    assert markdown[0] == f"| | `{second[:8]}` | `{first[:8]}` |"
    assert f"| {KL} | 0.01 | 0.001 |" in markdown
    assert any(line.startswith("| uplift |") and "p = 0.81, 1,319 questions" in line for line in markdown)

    assert main([*base, "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["run_id"], r[KL], r["promotion"]) for r in rows] == [
        (second, "0.01", "challenger"),
        (first, "0.001", "champion"),
    ]
    assert float(rows[1]["uplift 95% CI low"]) == pytest.approx(-0.012)

    assert main([*base, "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records[1]["uplift p (McNemar)"] == pytest.approx(0.17) and records[1]["compared_with"] == "the base model"


def test_plot_overlays_the_runs_curves(two_runs, tmp_path, capsys):
    uri, _ = two_runs
    out = tmp_path / "cmp.png"
    assert main(["compare", "--tracking-uri", uri, "--experiment", "cmp", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["compare", "--tracking-uri", uri, "--plot", str(tmp_path / "cmp.svg")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --plot writes a PNG")
