"""Champion vs challenger: the decision against hand-worked tables, then the registry through the pipeline's
own code (record_results, the flow's champion lookup) against a real `mlflow server` on loopback."""

import hashlib
import json
from pathlib import Path

import pytest

from grpo_core.config.load import load_config
from grpo_core.evaluation.gsm8k import compare_evaluations, write_eval_set
from grpo_core.evaluation.stats import paired_uplift
from grpo_core.pipeline.promotion import CHALLENGER, CHAMPION, Promotion, decide, eval_set_tags, judge_note
from tests.conftest import REPO
from tests.support.servers import mlflow_server


def test_a_clear_significant_gain_is_promoted():
    # 20 questions, the new model right on 10 the opponent missed and nowhere worse: uplift 0.5,
    # McNemar p = 2 · 0.5^10 = 0.001953
    r = paired_uplift([False] * 20, [True] * 10 + [False] * 10)
    assert r["p_value"] == pytest.approx(0.001953, abs=1e-6)
    p = decide(r, "champion version 3", min_uplift=0.0, alpha=0.05)
    assert p.alias == CHAMPION and p.promoted
    assert "over champion version 3 on 20 questions" in p.reason and "promoted to champion" in p.reason


def test_a_gain_that_may_be_noise_stays_challenger():
    # 6 against 1 on 20 (tests/test_stats.py): uplift +0.25 but p = 0.125
    base = [True] * 8 + [False] * 6 + [True] + [False] * 5
    trained = [True] * 8 + [True] * 6 + [False] + [False] * 5
    p = decide(paired_uplift(base, trained), "the base model", min_uplift=0.0, alpha=0.05)
    assert p.alias == CHALLENGER
    assert "p not below 0.05 (the difference may be noise)" in p.reason and "not above" not in p.reason
    assert p.reason.endswith("registered as challenger, there is no champion yet")
    assert "uplift +0.2500 [-0.0093, +0.4623]" in p.reason and "p = 0.125" in p.reason


def test_significant_but_below_the_minimum_uplift_and_the_boundaries():
    r = {"uplift": 0.02, "ci_low": 0.01, "ci_high": 0.03, "p_value": 0.001, "n": 5000}
    below = decide(r, "champion version 1", min_uplift=0.05, alpha=0.05)
    assert below.alias == CHALLENGER and "not above the minimum +0.0500" in below.reason
    # equal to the minimum is not above it; p equal to alpha is not below it
    assert decide(r, "x", min_uplift=0.02, alpha=0.05).alias == CHALLENGER
    assert decide({**r, "p_value": 0.05}, "x", min_uplift=0.0, alpha=0.05).alias == CHALLENGER
    # no discordant pair at all (all concordant): p = 1, never promoted
    same = paired_uplift([True, False, True], [True, False, True])
    assert decide(same, "x", min_uplift=-1.0, alpha=1.0).alias == CHALLENGER


def test_tags_round_trip():
    p = decide(paired_uplift([False] * 20, [True] * 10 + [False] * 10), "the base model", 0.0, 0.05)
    tags = p.tags()
    assert tags["grpo.promotion"] == "champion" and tags["grpo.compared_with"] == "the base model"
    assert tags["grpo.uplift"] == "+0.500000" and tags["grpo.questions"] == "20"
    back = Promotion.from_tags(tags)
    assert back.alias == p.alias and back.reason == p.reason
    assert back.uplift == pytest.approx(p.uplift) and back.ci_low == pytest.approx(p.ci_low, abs=1e-6)


def write_eval(
    directory: Path, correct: list[bool], metric: str = "accuracy_strict", eval_set: tuple[str, list[str]] | None = None
) -> Path:
    """An evaluation's records as `grpo evaluate` writes them (one greedy sample per question); ``eval_set``: the
    data's digest and the questions' ids, recorded with them (eval_set.json) as `grpo evaluate` does."""
    directory.mkdir(parents=True, exist_ok=True)
    records = [
        {"index": i, "sample": 0, "correct_strict": c, "correct_flexible": c, "format_ok": True}
        for i, c in enumerate(correct)
    ]
    if eval_set is not None:
        for record, question in zip(records, eval_set[1], strict=True):
            record["id"] = question
        write_eval_set(directory, eval_set[0], records)
    (directory / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = {metric: sum(correct) / len(correct), "num_questions": float(len(correct))}
    (directory / "metrics.json").write_text(json.dumps(metrics))
    return directory


def eval_set(name: str, questions: int = 20) -> tuple[str, list[str]]:
    """An evaluation set: its data's digest and its questions' ids (row_id-like)."""
    return hashlib.sha256(name.encode()).hexdigest(), [f"{name}{i:015d}"[:16] for i in range(questions)]


def test_compare_evaluations_pairs_by_question(tmp_path):
    a = write_eval(tmp_path / "a", [True, False, False, True])
    b = write_eval(tmp_path / "b", [True, True, False, True])
    r = compare_evaluations(a, b, "accuracy_strict")
    assert (r["only_trained"], r["only_base"], r["uplift"]) == (1, 0, 0.25)
    c = write_eval(tmp_path / "c", [True])
    with pytest.raises(ValueError, match="different questions"):
        compare_evaluations(a, c, "accuracy_strict")


def test_evaluations_of_another_set_are_never_compared_even_with_as_many_questions(tmp_path):
    """Paired by question id: two evaluations of 4 questions each, 3 of them the same, are not comparable."""
    digest, ids = eval_set("a", 4)
    a = write_eval(tmp_path / "a", [True, False, False, True], eval_set=(digest, ids))
    b = write_eval(tmp_path / "b", [True, True, False, True], eval_set=(digest, ids[:3] + ["another question"]))
    with pytest.raises(ValueError, match=r"different questions \(4 and 4, 3 in common\)"):
        compare_evaluations(a, b, "accuracy_strict")
    shuffled = write_eval(tmp_path / "s", [True, False, True, True], eval_set=(digest, [ids[i] for i in (2, 1, 0, 3)]))
    assert compare_evaluations(a, shuffled, "accuracy_strict")["uplift"] == 0.25  # the same questions, any order


def test_the_judge_note_says_when_the_evaluation_set_changed():
    tags = eval_set_tags({"data_digest": "a" * 64, "questions": ["q1", "q2"]})
    assert tags["grpo.eval.questions"] == "2" and len(tags["grpo.eval.ids_sha256"]) == 64
    assert judge_note(tags, tags, "champion version 3") == ""
    more = eval_set_tags({"data_digest": "b" * 64, "questions": ["q1", "q2", "q3"]})
    assert judge_note(tags, more, "champion version 3") == (
        f"the evaluation set changed since champion version 3 was judged (2 questions of data digest {'a' * 12} "
        f"then, 3 of {'b' * 12} now); it was evaluated again on the new set"
    )
    fewer = eval_set_tags({"data_digest": "a" * 64, "questions": ["q1"]})  # same file, another evaluation.limit
    assert "(2 questions of data digest aaaaaaaaaaaa then, 1 of aaaaaaaaaaaa now)" in judge_note(tags, fewer, "x")
    assert judge_note({"grpo.promotion": "champion"}, tags, "champion version 1") == (
        "champion version 1 records no evaluation set; it was evaluated on this one (2 questions)"
    )


def test_first_run_champion_then_noise_is_challenger_then_a_real_gain_is_promoted(tmp_path):
    """Three pipeline runs' results on 20 questions, through record_results and the flow's own champion lookup
    (which downloads the champion version from the registry). The third run's evaluation set is another one
    (issue 38): the champion, judged on the first, is evaluated on the new set (kept under another cache key) and
    the comparison says so; its evaluation on the old set is never compared with the new one."""
    from mlflow import MlflowClient

    from grpo_core.pipeline.champion import champion_model, promotion_of
    from grpo_core.pipeline.evaluations import eval_dir
    from grpo_core.pipeline.record import record_results
    from grpo_core.pipeline.report import markdown_report
    from grpo_core.pipeline.run import open_pipeline_run

    base_correct = [True] * 4 + [False] * 16
    trained_correct = {
        1: [True] * 14 + [False] * 6,  # +10 over the base: p = 0.002, champion
        2: [True] * 15 + [False] * 5,  # +1 over champion v1: p = 1, challenger
        3: [True] * 20,  # +6 over champion v1, none worse: p = 0.031, champion
    }
    sets = {1: eval_set("a"), 2: eval_set("a"), 3: eval_set("b")}  # the third run's questions are others
    cached, mlflow_runs = {}, {}
    with mlflow_server(tmp_path / "mlflow") as uri:
        client = MlflowClient(uri)
        outcomes = {}
        for i in (1, 2, 3):
            root = tmp_path / f"run{i}"
            overrides = [
                f"trainer.default_local_dir={root}",
                "trainer.project_name=promotion_test",
                f"tracking.mlflow_tracking_uri={uri}",
                f"tracking.model_cache_dir={tmp_path / 'cache'}",
            ]
            cfg = load_config(REPO / "configs/demo_cpu.yaml", overrides)
            run = open_pipeline_run(cfg, f"key{i}", {}, root)
            model_dir = root / "model"
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "run": i}))
            judge = sets[i]
            eval_dirs = {
                "base": write_eval(root / "eval" / "base", base_correct, eval_set=judge),
                "trained": write_eval(root / "eval" / "trained", trained_correct[i], eval_set=judge),
            }
            champion = champion_model(cfg)
            if champion is not None:
                # the flow evaluates the champion's files, once per evaluation set (eval_dir keyed on the set's
                # digest); here: its run's trained records, as they would be, on this run's set
                assert json.loads((champion.path / "config.json").read_text())["run"] == int(champion.version)
                cached[i] = eval_dir(champion, judge[0], {"limit": 20})
                correct = trained_correct[int(champion.version)]
                eval_dirs["champion"] = write_eval(root / "eval" / "champion", correct, eval_set=judge)
                if i == 3:  # the champion's records on the set it was judged on: never compared with the new set
                    eval_dirs["champion"] = write_eval(root / "eval" / "old", correct, eval_set=sets[1])
                    with pytest.raises(ValueError, match="different questions"):
                        promotion_of(cfg, eval_dirs, champion.version, champion.tags)
                    eval_dirs["champion"] = root / "eval" / "champion"
            summary = record_results(
                run,
                cfg,
                json.loads((eval_dirs["base"] / "metrics.json").read_text()),
                json.loads((eval_dirs["trained"] / "metrics.json").read_text()),
                str(root / "ckpt"),
                eval_dirs,
                model_dir,
                champion_version=champion.version if champion else None,
                champion_tags=champion.tags if champion else None,
            )
            run.finish()
            assert run.close()
            champion_now = client.get_model_version_by_alias("promotion_test", "champion").version
            version = client.get_model_version("promotion_test", summary.model_version)
            outcomes[i] = (summary.promotion, str(champion_now), version.tags, markdown_report(summary, cfg))
            mlflow_runs[i] = client.get_run(run.run_id)
        experiment = client.get_experiment_by_name("promotion_test")
        figures = {a.path for a in client.list_artifacts(mlflow_runs[1].info.run_id, "figures")}

    # issue 44: MLflow's model-training view, the report as the run's description, the headline numbers as metrics
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    first = mlflow_runs[1].data
    assert first.tags["mlflow.note.content"] == outcomes[1][3]  # the same text as the Prefect artifact
    assert "**+0.5000** [" in first.tags["mlflow.note.content"] and "promoted to champion" in outcomes[1][3]
    assert {k: first.metrics[k] for k in ("accuracy_before", "accuracy_after", "uplift")} == pytest.approx(
        {"accuracy_before": 0.2, "accuracy_after": 0.7, "uplift": 0.5}
    )
    assert first.metrics["uplift_ci95_low"] < 0.5 < first.metrics["uplift_ci95_high"]
    assert first.metrics["uplift_p_value"] == pytest.approx(0.001953, abs=1e-6)
    assert first.metrics["format_rate_before"] == first.metrics["format_rate_after"] == 1.0
    assert "tokens_per_s_per_gpu" in first.metrics
    assert figures == {"figures/reward_and_format_rate.png", "figures/before_after.png"}

    promotion, champion_now, tags, report = outcomes[1]
    assert (promotion, champion_now) == ("champion", "1")
    assert tags["grpo.compared_with"] == "the base model" and tags["grpo.uplift"] == "+0.500000"
    assert tags["grpo.promotion_reason"].startswith("uplift +0.5000")  # against the base model: no judge to note
    assert "promoted to champion" in tags["grpo.promotion_reason"]
    assert "| model version | 1 (champion) |" in report and "promoted to champion" in report
    # the set that judged it, recorded with it: the data's digest, the questions and the digest of their ids
    assert tags["grpo.eval_data_digest"] == sets[1][0] and tags["grpo.eval.questions"] == "20"
    assert tags["grpo.eval.ids_sha256"] == hashlib.sha256("\n".join(sets[1][1]).encode()).hexdigest()

    promotion, champion_now, tags, report = outcomes[2]
    assert (promotion, champion_now) == ("challenger", "1")  # the alias did not move
    assert tags["grpo.compared_with"] == "champion version 1" and tags["grpo.uplift"] == "+0.050000"
    assert float(tags["grpo.uplift_p_value"]) == 1.0
    assert tags["grpo.promotion_reason"].startswith("uplift +0.0500")  # the champion's own set: nothing to say
    assert "may be noise" in tags["grpo.promotion_reason"] and "the champion stays" in tags["grpo.promotion_reason"]
    assert "| model version | 2 (challenger) |" in report and "may be noise" in report

    promotion, champion_now, tags, report = outcomes[3]
    assert (promotion, champion_now) == ("champion", "3")
    assert tags["grpo.compared_with"] == "champion version 1" and tags["grpo.uplift"] == "+0.300000"
    assert float(tags["grpo.uplift_p_value"]) == pytest.approx(0.03125)
    assert "p = 0.0312" in tags["grpo.promotion_reason"]
    assert tags["grpo.promotion_reason"].startswith(
        f"the evaluation set changed since champion version 1 was judged (20 questions of data digest "
        f"{sets[1][0][:12]} then, 20 of {sets[3][0][:12]} now); it was evaluated again on the new set: uplift +0.3000"
    )
    assert "evaluation set changed" in report and tags["grpo.eval_data_digest"] == sets[3][0]
    assert cached[2] != cached[3]  # the champion's evaluation on the new set is kept apart from the old one's
