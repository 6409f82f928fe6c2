"""GSM8K evaluation: the pure helpers by hand, scoring through a scripted engine, and end to end on a tiny model."""

import json
import math
import shutil
import time
from pathlib import Path

import pytest

from grpo_core.data.gsm8k import DataError
from grpo_core.data.lineage import dataset_digest
from grpo_core.data.prompts import row_id
from grpo_core.evaluation import (
    EvalResult,
    accuracy_uplift,
    evaluate,
    load_rows,
    majority_vote,
    pass_at_k,
    write_results,
)
from grpo_core.evaluation.gsm8k import paired_outcomes, read_samples
from grpo_core.rollout import Generation, SamplingSettings
from tests.support.tiny import TOKENIZER

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # not its 135M config.json


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # n - c < k: every pair holds a correct sample
    assert pass_at_k(1, 1, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_vote_by_hand():
    assert majority_vote(["3", "5", "3"]) == "3"
    assert majority_vote(["18", "5", "18.00"]) == "18"  # numerically equal answers vote together
    assert majority_vote(["4", "5"]) == "4"  # a tie goes to the answer seen first
    assert majority_vote([None, "7", None]) == "7"  # no answer, no vote
    assert majority_vote([None, None]) is None
    assert majority_vote([]) is None


def test_accuracy_uplift():
    trained = {"accuracy_strict": 0.5, "format_rate": 0.2, "maj@8_strict": 1.0}
    base = {"accuracy_strict": 0.25, "format_rate": 0.2}
    assert accuracy_uplift(trained, base) == {"accuracy_strict_uplift": 0.25, "format_rate_uplift": 0.0}


class ScriptedTokenizer:
    """A prompt's token is its question's index; a response's token is its text's index."""

    def __init__(self, questions: list[str], texts: list[str]) -> None:
        self.questions, self.texts = questions, texts

    def apply_chat_template(self, messages, add_generation_prompt=False):
        assert add_generation_prompt
        return [self.questions.index(messages[-1]["content"])]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.texts[i] for i in ids)


class ScriptedEngine:
    """A RolloutEngine returning ``script[question index]`` (n responses, as text indices)."""

    def __init__(self, script: dict[int, list[int]]) -> None:
        self.script, self.calls = script, []

    def generate(self, prompt_ids, settings: SamplingSettings) -> Generation:
        self.calls.append((prompt_ids, settings))
        responses = [[t] for p in prompt_ids for t in self.script[p[0]][: settings.n]]
        return Generation(
            prompt_ids=prompt_ids,
            response_ids=responses,
            response_log_probs=[[-1.0] for _ in responses],
            finish_reasons=["stop"] * len(responses),
            group_index=[i for i in range(len(prompt_ids)) for _ in range(settings.n)],
        )

    def update_weights(self, named_tensors) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


def scripted(golds: list[str], answers: list[list[str]]):
    questions = [f"question {i}" for i in range(len(golds))]
    texts = [text for group in answers for text in group]
    script, start = {}, 0
    for i, group in enumerate(answers):
        script[i], start = list(range(start, start + len(group))), start + len(group)
    rows = [
        {"prompt": [{"role": "user", "content": q}], "reward_model": {"ground_truth": g}, "extra_info": {"question": q}}
        for q, g in zip(questions, golds, strict=True)
    ]
    return ScriptedEngine(script), ScriptedTokenizer(questions, texts), rows


def test_decode_responses_gives_what_decoding_each_response_gives():
    """The batch decode on SmolLM2's tokenizer against transformers' decode of each response: special tokens (the
    chat template's, end of text) dropped, multi-byte characters, spaces; and the per-response path where
    transformers would clean up spaces."""
    from transformers import AutoTokenizer

    from grpo_core.data.prompts import decode_responses

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    texts = ["So 3 + 4 = 7.\n#### 7<|im_end|>", " Ça coûte 12€ , donc  #### 12 ", "<|im_start|>assistant\n48/2", ""]
    responses = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    want = [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
    assert decode_responses(tokenizer, responses) == want
    assert want[0] == "So 3 + 4 = 7.\n#### 7" and want[1] == texts[1]
    tokenizer.clean_up_tokenization_spaces = True
    assert decode_responses(tokenizer, responses)[1] == tokenizer.decode(responses[1], skip_special_tokens=True)


def test_evaluate_greedy_scores_by_hand():
    answers = [["so #### 12"], ["it is 3, #### 7"], ["the answer is 5"], ["#### 3"]]
    engine, tokenizer, rows = scripted(["12", "7", "5", "4"], answers)
    result = evaluate(engine, tokenizer, rows, batch_size=3, progress=False)
    assert [len(prompts) for prompts, _ in engine.calls] == [3, 1]
    assert all(settings.is_greedy and settings.n == 1 for _, settings in engine.calls)
    assert [r["index"] for r in result.records] == [0, 1, 2, 3]
    assert [r["correct_strict"] for r in result.records] == [True, True, False, False]
    assert [r["correct_flexible"] for r in result.records] == [True, True, True, False]
    assert [r["format_ok"] for r in result.records] == [True, True, False, True]
    assert result.records[2] | {"response_tokens": 1} == {
        "index": 2,
        "id": row_id([{"role": "user", "content": "question 2"}], "5"),  # the question's identity (issue 38)
        "sample": 0,
        "question": "question 2",
        "response": "the answer is 5",
        "answer_strict": None,
        "answer_flexible": "5",
        "gold": "5",
        "correct_strict": False,
        "correct_flexible": True,
        "format_ok": False,
        "finish_reason": "stop",
        "response_tokens": 1,
    }
    m = result.metrics
    assert (m["accuracy_strict"], m["accuracy_flexible"], m["format_rate"]) == (0.5, 0.75, 0.75)
    assert m["num_questions"] == 4 and not any(name.startswith(("pass@", "maj@")) for name in m)


def test_evaluate_samples_pass_and_maj_at_k_by_hand():
    answers = [["#### 12", "#### 11", "#### 12", "12"], ["#### 5", "#### 6", "#### 6", "no idea"]]
    engine, tokenizer, rows = scripted(["12", "5"], answers)
    result = evaluate(engine, tokenizer, rows, n=4, temperature=1.0, k_values=(1, 2, 4), progress=False)
    assert not engine.calls[0][1].is_greedy and engine.calls[0][1].temperature == 1.0
    assert [(r["index"], r["sample"]) for r in result.records] == [(q, s) for q in range(2) for s in range(4)]
    m = result.metrics
    # strict: 2/4 right, then 1/4 right; flexible: 3/4, then 1/4
    assert m["accuracy_strict"] == 3 / 8 and m["accuracy_flexible"] == 4 / 8
    assert m["pass@1_strict"] == pytest.approx(3 / 8)
    assert m["pass@2_strict"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6)) / 2)
    assert m["pass@2_flexible"] == pytest.approx((1 + (1 - 3 / 6)) / 2)
    assert m["pass@4_strict"] == 1.0
    assert m["maj@1_strict"] == 1.0
    assert m["maj@2_strict"] == 1.0  # ties go to the first answer: 12 and 5, both right
    assert m["maj@4_strict"] == 0.5  # 12 wins; 6 beats 5
    with pytest.raises(ValueError, match="between 1 and n=4"):
        evaluate(engine, tokenizer, rows, n=4, temperature=1.0, k_values=(8,), progress=False)


def test_write_results_and_load_rows_errors(tmp_path):
    result = EvalResult(records=[{"index": 0, "response": "ünïcode #### 1"}], metrics={"accuracy_strict": 1.0})
    out = write_results(result, tmp_path / "eval")
    assert [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()] == result.records
    assert json.loads((out / "metrics.json").read_text()) == result.metrics
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "samples.jsonl"]  # no temp files left
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "missing.parquet")


def test_metrics_json_has_a_wilson_interval_beside_each_proportion(tmp_path):
    metrics = {"accuracy_strict": 0.25, "format_rate": 0.0, "num_questions": 16.0, "response_tokens_mean": 40.0}
    written = json.loads((write_results(EvalResult([], metrics), tmp_path) / "metrics.json").read_text())
    # 4 of 16: (0.101821, 0.494983); 0 of 16: (0, z²/(16 + z²) = 3.841459 / 19.841459 = 0.193608)
    assert written["accuracy_strict_ci95"] == pytest.approx([0.101821, 0.494983], abs=1e-6)
    assert written["format_rate_ci95"] == pytest.approx([0.0, 0.193608], abs=1e-6)
    assert not {"num_questions_ci95", "response_tokens_mean_ci95"} & written.keys()


def test_paired_outcomes_take_each_questions_first_sample_in_question_order(tmp_path):
    def record(index: int, sample: int, correct: bool) -> dict:
        return {"index": index, "sample": sample, "correct_strict": correct}

    base = [record(1, 0, True), record(1, 1, False), record(0, 0, False), record(0, 1, True)]
    trained = [record(0, 0, True), record(1, 0, True)]
    write_results(EvalResult(base, {}), tmp_path)
    assert paired_outcomes(read_samples(tmp_path), trained, "correct_strict") == ([False, True], [True, True])
    with pytest.raises(ValueError, match="different questions"):
        paired_outcomes(base, trained[:1], "correct_strict")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="is not a readable Parquet file"):
        load_rows(tmp_path / "bad.parquet")


# --- end to end on a tiny random Llama ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_test(tmp_path_factory) -> Path:
    from grpo_core.data.gsm8k import prepare_gsm8k

    out = tmp_path_factory.mktemp("gsm8k")
    prepare_gsm8k("embedded", out, progress=False)
    return out / "test.parquet"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved with the SmolLM2 tokenizer: what `grpo export` leaves behind."""
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    from tests.support.tiny import tiny_llama

    out = tmp_path_factory.mktemp("tiny_model")
    tiny_llama().save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy2(TOKENIZER / name, out / name)
    return out


def test_evaluate_end_to_end_with_hf_engine(gsm8k_test, tiny_model_dir):
    from grpo_core.rollout.hf import HFEngine, load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    engine = HFEngine(str(tiny_model_dir), tokenizer)
    rows = load_rows(gsm8k_test, limit=4)
    start = time.perf_counter()
    result = evaluate(engine, tokenizer, rows, max_new_tokens=16, progress=False)
    seconds = time.perf_counter() - start
    print(
        f"evaluate: {result.response_tokens} tokens in {seconds:.2f} s = {result.response_tokens / seconds:.0f} tok/s"
    )
    assert len(result.records) == 4
    fields = {"index", "id", "sample", "question", "response", "answer_strict", "answer_flexible", "gold"}
    fields |= {"correct_strict", "correct_flexible", "format_ok", "finish_reason", "response_tokens"}
    for record, row in zip(result.records, rows, strict=True):
        assert set(record) == fields
        assert record["question"] == row["extra_info"]["question"]
        assert record["gold"] == row["reward_model"]["ground_truth"]
        assert 1 <= record["response_tokens"] <= 16
    for name in ("accuracy_strict", "accuracy_flexible", "format_rate", "truncated_rate"):
        assert 0.0 <= result.metrics[name] <= 1.0


def test_cli_evaluate(gsm8k_test, tiny_model_dir, tmp_path, capsys):
    from grpo_core.cli import main

    out = tmp_path / "eval"
    argv = ["evaluate", "--model", str(tiny_model_dir), "--data", str(gsm8k_test), "--output", str(out)]
    argv += ["--limit", "2", "--n", "2", "--temperature", "1.0", "--max-new-tokens", "4", "--k", "1", "2"]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"accuracy_strict", "pass@2_strict", "maj@2_strict"} <= metrics.keys()
    assert len((out / "samples.jsonl").read_text().splitlines()) == 4
    # the questions asked, beside the records: what a model version records as the set that judged it
    asked = [row_id(row["prompt"], row["reward_model"]["ground_truth"]) for row in load_rows(gsm8k_test, limit=2)]
    judged = {"data_digest": dataset_digest([gsm8k_test]), "questions": asked}
    assert json.loads((out / "eval_set.json").read_text()) == judged
    printed = capsys.readouterr().out
    assert "pass@2_strict:" in printed and str(out / "samples.jsonl") in printed


def test_cli_evaluate_bad_input(gsm8k_test, tiny_model_dir, tmp_path, capsys):
    from grpo_core.cli import main

    missing_data = ["evaluate", "--model", str(tiny_model_dir), "--data", str(tmp_path / "nope.parquet")]
    assert main(missing_data) == 2
    err = capsys.readouterr().err
    assert f"error: data file {tmp_path / 'nope.parquet'} does not exist" in err and "Traceback" not in err

    missing_model = ["evaluate", "--model", str(tmp_path / "no_model"), "--data", str(gsm8k_test)]
    assert main(missing_model) == 2
    err = capsys.readouterr().err
    assert f"error: model directory {tmp_path / 'no_model'} does not exist" in err and "Traceback" not in err

    assert main(["evaluate", "--model", str(tiny_model_dir), "--data", str(gsm8k_test), "--n", "2", "--k", "4"]) == 2
    assert "every --k must be between 1 and --n=2" in capsys.readouterr().err


def test_cli_evaluate_static_engine_answers_as_hf_does(gsm8k_test, tiny_model_dir, tmp_path):
    """Greedy fp32: the static-cache engine writes the same answers, token for token, as transformers' generate."""
    from grpo_core.cli import main

    answers = {}
    for engine in ("hf", "static"):
        out = tmp_path / engine
        argv = ["evaluate", "--model", str(tiny_model_dir), "--data", str(gsm8k_test), "--output", str(out)]
        assert main([*argv, "--limit", "4", "--max-new-tokens", "12", "--engine", engine]) == 0
        answers[engine] = [json.loads(line)["response"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(answers["hf"]) == 4 and answers["static"] == answers["hf"]


def test_static_engine_sizes_its_cache_for_the_longest_prompt(gsm8k_test, tiny_model_dir, tmp_path):
    """A prompt longer than max_prompt_length is still answered (as the HF engine answers it), not an error."""
    from grpo_core.evaluation.run import EvalSettings, evaluate_model

    answers = {}
    for engine in ("hf", "static"):
        settings = EvalSettings(max_new_tokens=8, limit=2, engine=engine, max_prompt_length=4)
        result = evaluate_model(str(tiny_model_dir), str(gsm8k_test), tmp_path / engine, settings)
        answers[engine] = [r["response"] for r in result.records]
    assert len(answers["hf"]) == 2 and answers["static"] == answers["hf"]
