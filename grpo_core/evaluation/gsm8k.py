"""GSM8K evaluation: sample answers with any rollout engine, grade them with the training reward's extractor.

``evaluate`` yields one record per sample and reduces them to accuracies; grading reuses
``grpo_core.rewards.gsm8k`` so the reported metric and the training reward cannot drift apart.
With one greedy sample the accuracy is pass@1; with n samples it is their mean (the pass@1
estimate), plus maj@k and the unbiased pass@k. Everything runs in this process: a caller that
shards rows over ranks gathers the records and calls ``summarize`` itself.
"""

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, TextColumn

from grpo_core.atomic import write_text_atomic
from grpo_core.config.defaults import SETTING, defaults_from
from grpo_core.data.prompts import chat_prompt_ids, decode_responses, row_id
from grpo_core.evaluation.stats import wilson_interval
from grpo_core.records.data import EvalSet
from grpo_core.records.reader import read_json_as_written
from grpo_core.rewards.gsm8k import answers_match, extract_solution
from grpo_core.rollout.base import RolloutEngine, SamplingSettings

SAMPLES_FILE = "samples.jsonl"
METRICS_FILE = "metrics.json"
EVAL_SET_FILE = "eval_set.json"  # the questions evaluated: {"data_digest": dataset_digest, "questions": [row ids]}


@dataclass(frozen=True)
class EvalProgress:
    """Where an evaluation is, after a generate call: what the pipeline's task log and a terminal without the bar
    show, so a long evaluation is never silent until it ends."""

    done: int  # questions answered so far
    total: int
    tokens: int  # response tokens generated so far
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.elapsed_s, 1e-9)

    def line(self, name: str) -> str:
        """``evaluate base: 8/16 questions, 768 tokens in 9.1 s (84 tokens/s)``"""
        rate = f"{self.tokens} tokens in {self.elapsed_s:.1f} s ({self.tokens_per_s:.0f} tokens/s)"
        return f"evaluate {name}: {self.done}/{self.total} questions, {rate}"


@dataclass
class EvalResult:
    records: list[dict]  # one per sample, grouped by question
    metrics: dict[str, float]
    elapsed_s: float = 0.0  # generation and grading wall time
    response_tokens: int = 0  # tokens generated in total (for throughput)
    device: str = "cpu"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _number_key(answer: str) -> Decimal | str:
    """'18', '18.0' and '18.00' are one vote."""
    try:
        return Decimal(answer).normalize()
    except InvalidOperation:
        return answer


def majority_vote(answers: list[str | None]) -> str | None:
    """The most common answer (numerically equal answers count together); None answers do not vote.

    Ties go to the answer seen first, so the vote is deterministic. None when nobody answered.
    """
    votes = [a for a in answers if a is not None]
    if not votes:
        return None
    counts = Counter(_number_key(a) for a in votes)
    best = max(counts.values())
    return next(a for a in votes if counts[_number_key(a)] == best)


def grade(response: str, gold: str) -> dict:
    """The per-sample fields that depend only on the text and the reference answer."""
    strict, flexible = extract_solution(response, "strict"), extract_solution(response, "flexible")
    return {
        "answer_strict": strict,
        "answer_flexible": flexible,
        "gold": gold,
        "correct_strict": strict is not None and answers_match(strict, gold),
        "correct_flexible": flexible is not None and answers_match(flexible, gold),
        "format_ok": strict is not None,
    }


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(records: list[dict], n: int, k_values: tuple[int, ...] = (1,)) -> dict[str, float]:
    """Accuracies over records grouped n per question (in order).

    accuracy_* is the mean over all samples: pass@1 for one greedy sample, its unbiased estimate for n.
    With n > 1, for each k: pass@k_{strict,flexible} (unbiased) and maj@k_strict, the majority vote of
    the first k samples' strict answers. Strict because the vote should be over answers the model
    marked as final; the flexible "last number" often picks an intermediate result.
    """
    questions = [records[i : i + n] for i in range(0, len(records), n)]
    metrics = {
        "accuracy_strict": _mean([r["correct_strict"] for r in records]),
        "accuracy_flexible": _mean([r["correct_flexible"] for r in records]),
        "format_rate": _mean([r["format_ok"] for r in records]),
        "truncated_rate": _mean([r["finish_reason"] == "length" for r in records]),
        "response_tokens_mean": _mean([r["response_tokens"] for r in records]),
        "num_questions": float(len(questions)),
    }
    if n == 1:
        return metrics
    for k in k_values:
        for method in ("strict", "flexible"):
            correct = [sum(r[f"correct_{method}"] for r in group) for group in questions]
            metrics[f"pass@{k}_{method}"] = _mean([pass_at_k(n, c, k) for c in correct])
        voted = [(majority_vote([r["answer_strict"] for r in group[:k]]), group[0]["gold"]) for group in questions]
        metrics[f"maj@{k}_strict"] = _mean([a is not None and answers_match(a, gold) for a, gold in voted])
    return metrics


@defaults_from("evaluation")
def evaluate(
    engine: RolloutEngine,
    tokenizer,
    rows: list[dict],
    n: int = SETTING,
    temperature: float = SETTING,
    max_new_tokens: int = SETTING,
    batch_size: int = 32,  # prompts per call: evaluation.batch_size counts sequences (evaluate_model divides by n)
    k_values: tuple[int, ...] = (1,),
    seed: int = 0,  # evaluation's own sampling seed: it has no seed setting (rollout.seed is the training engine's)
    progress: bool = True,
    on_batch: Callable[[EvalProgress], None] | None = None,
) -> EvalResult:
    """Sample ``n`` responses per row (greedy at temperature 0), grade each and summarize.

    ``batch_size`` is prompts per ``engine.generate`` call (the engine may split further). ``on_batch(progress)``
    after each call: where no terminal shows the bar (the pipeline's task log). The bar (questions, tokens/s) is
    drawn on a terminal only: off one, rich prints it once, at the end, as a blank line.
    """
    if bad := [k for k in k_values if not 1 <= k <= n]:
        raise ValueError(f"every k must be between 1 and n={n}; got {bad}")
    settings = SamplingSettings(
        n=n, temperature=temperature, max_new_tokens=max_new_tokens, greedy=temperature == 0, seed=seed
    )
    records: list[dict] = []
    start = time.perf_counter()
    console = Console(stderr=True)
    columns = (*Progress.get_default_columns(), TextColumn("{task.fields[rate]}"))
    with Progress(*columns, console=console, disable=not (progress and console.is_terminal), transient=True) as bar:
        task = bar.add_task("gsm8k eval", total=len(rows), rate="")
        tokens = 0
        for first in range(0, len(rows), batch_size):
            batch = rows[first : first + batch_size]
            gen = engine.generate([chat_prompt_ids(tokenizer, row["prompt"]) for row in batch], settings)
            texts = decode_responses(tokenizer, gen.response_ids)
            for j, (ids, response) in enumerate(zip(gen.response_ids, texts, strict=True)):
                row = batch[gen.group_index[j]]
                records.append(
                    {
                        "index": first + gen.group_index[j],
                        "id": row_id(row["prompt"], row["reward_model"]["ground_truth"]),
                        "sample": j % n,
                        "question": (row.get("extra_info") or {}).get("question") or row["prompt"][-1]["content"],
                        "response": response,
                        **grade(response, str(row["reward_model"]["ground_truth"])),
                        "finish_reason": gen.finish_reasons[j],
                        "response_tokens": len(ids),
                    }
                )
            tokens += sum(len(ids) for ids in gen.response_ids)
            now = EvalProgress(first + len(batch), len(rows), tokens, time.perf_counter() - start)
            bar.update(task, advance=len(batch), rate=f"{now.tokens_per_s:.0f} tokens/s")
            if on_batch is not None:
                on_batch(now)
    elapsed = time.perf_counter() - start
    tokens = sum(r["response_tokens"] for r in records)
    return EvalResult(records, summarize(records, n, tuple(k_values)), elapsed_s=elapsed, response_tokens=tokens)


def is_proportion(name: str) -> bool:
    """The metrics that are shares of samples: each gets a Wilson interval."""
    return name.startswith(("accuracy_", "pass@", "maj@")) or name == "format_rate"


def intervals(metrics: dict[str, float]) -> dict[str, list[float]]:
    """``<metric>_ci95``: the 95% Wilson interval of every proportion, over the questions.

    Over questions, not samples: with n samples per question the samples of one question are not
    independent, so counting them all would make the interval too narrow; with one sample (the pipeline's
    greedy evaluation) the two are the same."""
    questions = int(metrics.get("num_questions", 0))
    if not questions:
        return {}
    return {
        f"{name}_ci95": list(wilson_interval(round(value * questions), questions))
        for name, value in metrics.items()
        if is_proportion(name)
    }


def read_samples(out_dir: str | Path) -> list[dict]:
    """The per-sample records ``write_results`` left in ``out_dir``."""
    text = (Path(out_dir) / SAMPLES_FILE).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def question_ids(records: list[dict]) -> list[str]:
    """The questions of an evaluation's records, in order: each row's ``row_id`` (its position, in records written
    before ids were)."""
    return [r.get("id", str(r["index"])) for r in records if r.get("sample", 0) == 0]


def write_eval_set(out_dir: str | Path, data_digest: str, records: list[dict]) -> None:
    """``eval_set.json`` beside the records: the evaluation data's digest and the questions asked."""
    record = {"data_digest": data_digest, "questions": question_ids(records)}
    write_text_atomic(Path(out_dir) / EVAL_SET_FILE, json.dumps(record) + "\n")


def read_eval_set(out_dir: str | Path) -> dict | None:
    """What ``write_eval_set`` wrote (typed: records/data.py; RecordError when it is not), or None (an evaluation
    from before it was written)."""
    path = Path(out_dir) / EVAL_SET_FILE
    return read_json_as_written(path, EvalSet) if path.is_file() else None


def paired_outcomes(base: list[dict], trained: list[dict], field: str) -> tuple[list[bool], list[bool]]:
    """``field`` (``correct_strict``, ``format_ok``...) of each question's first sample in both evaluations,
    paired by question id, in ``base``'s question order: the pairs a paired test needs. Raises ValueError when the
    questions differ: two evaluations are never compared across sets."""
    first = []
    for records in (base, trained):
        samples = sorted((r for r in records if r.get("sample", 0) == 0), key=lambda r: r["index"])
        first.append(dict(zip(question_ids(samples), (bool(r[field]) for r in samples), strict=True)))
    if first[0].keys() != first[1].keys():
        shared = len(first[0].keys() & first[1].keys())
        raise ValueError(
            f"the two evaluations answer different questions ({len(first[0])} and {len(first[1])}, {shared} in "
            "common); evaluate both on the same data with the same limit"
        )
    questions = list(first[0])
    return [first[0][q] for q in questions], [first[1][q] for q in questions]


def compare_evaluations(base_dir: str | Path, trained_dir: str | Path, metric: str) -> dict:
    """``paired_uplift`` of two evaluations of the same questions, by ``metric`` (accuracy_strict/_flexible)."""
    from grpo_core.evaluation.stats import paired_uplift

    field = metric.replace("accuracy_", "correct_")
    return paired_uplift(*paired_outcomes(read_samples(base_dir), read_samples(trained_dir), field))


def accuracy_uplift(trained: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """trained - base for every metric both have, named ``<metric>_uplift``."""
    return {f"{name}_uplift": trained[name] - base[name] for name in trained if name in base}


def write_results(result: EvalResult, out_dir: str | Path) -> Path:
    """``samples.jsonl`` (one record a line) and ``metrics.json`` (with each proportion's ``_ci95``) in
    ``out_dir``; returns the directory."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / SAMPLES_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.records))
    metrics = {**result.metrics, **intervals(result.metrics)}
    write_text_atomic(out / METRICS_FILE, json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return out
