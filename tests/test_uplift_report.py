"""The pipeline's uplift with its interval and p-value: computed from the two evaluations' per-sample records,
logged to MLflow and written the same way in the report (no Prefect, no training: the results side only)."""

import json

import pytest
from mlflow import MlflowClient

from grpo_core.config.load import load_config
from grpo_core.evaluation.gsm8k import EvalResult, summarize, write_results
from grpo_core.pipeline.record import record_results
from grpo_core.pipeline.report import markdown_report
from grpo_core.tracking.mlflow_run import MlflowRun


def _records(correct: list[bool]) -> list[dict]:
    return [
        {"index": i, "sample": 0, "correct_strict": c, "correct_flexible": c, "format_ok": c}
        | {"finish_reason": "stop", "response_tokens": 10, "answer_strict": None, "gold": "1"}
        for i, c in enumerate(correct)
    ]


def write_eval(out, correct: list[bool]) -> dict:
    records = _records(correct)
    write_results(EvalResult(records, summarize(records, 1)), out)
    return summarize(records, 1)


def test_record_results_logs_the_paired_interval_and_the_report_shows_it(tmp_path):
    # the hand-worked table of tests/test_stats.py: 8 both, 6 only trained, 1 only base, 5 neither
    base_right = [True] * 8 + [False] * 6 + [True] + [False] * 5
    trained_right = [True] * 14 + [False] * 6
    dirs = {"base": tmp_path / "eval" / "base", "trained": tmp_path / "eval" / "trained"}
    base, trained = write_eval(dirs["base"], base_right), write_eval(dirs["trained"], trained_right)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [f"trainer.default_local_dir={tmp_path / 'run'}", f"tracking.mlflow_tracking_uri={uri}"]
    cfg = load_config(None, [*overrides, "data.train_batch_size=4", "actor_rollout_ref.rollout.n=8"])
    (tmp_path / "run").mkdir()
    rows = [{"step": s, "reward/mean": 0.1 * s, "reward/std": 0.2, "reward/accuracy": 0.05 * s} for s in (1, 2, 3)]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = MlflowRun.create(uri, "uplift", "run")

    summary = record_results(run, cfg, base, trained, "ckpt", dirs, model_dir=None)
    assert run.close()
    assert summary.accuracy_uplift == pytest.approx(0.25) and summary.questions == 20
    assert summary.uplift_ci95 == pytest.approx((-0.009256, 0.462286), abs=1e-6)
    assert summary.uplift_p_value == pytest.approx(0.125)
    metrics = MlflowClient(uri).get_run(run.run_id).data.metrics
    assert metrics["val/accuracy_uplift_ci95_low"] == pytest.approx(-0.009256, abs=1e-6)
    assert metrics["val/accuracy_uplift_ci95_high"] == pytest.approx(0.462286, abs=1e-6)
    assert metrics["val/accuracy_uplift_p_value"] == pytest.approx(0.125)
    report = markdown_report(summary, cfg)
    uplift = "+0.250 [\N{MINUS SIGN}0.009, +0.462], p = 0.12, 20 questions"
    assert uplift in report
    # what moved: the format rate and the accuracy (here the same table), and the reward of step 1 against
    # step 3, 32 samples each: 0.2 +- 1.96 x sqrt(2 x 0.2² / 32) = 0.2 +- 0.098, z = 4
    assert summary.moved == [
        f"format rate (`#### N` answers, eval): 0.450 -> 0.700, {uplift}: no significant change (the interval holds 0)",
        "training reward (mean per sample): step 1 0.100 -> step 3 0.300, +0.200 [+0.102, +0.298], p < 0.001, "
        "32 samples a step: rose",
        f"accuracy (accuracy_strict, eval): 0.450 -> 0.700, {uplift}: no significant change (the interval holds 0)",
    ]
    assert all(f"- {line}" in report for line in summary.moved)
    written = json.loads((dirs["trained"] / "metrics.json").read_text())
    assert written["accuracy_strict_ci95"] == pytest.approx([0.481027, 0.854523], abs=1e-6)  # Wilson 14/20
