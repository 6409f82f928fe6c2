"""Champion or challenger: does a newly trained model replace the registry's ``champion``?

Only when it beats the current champion (the base model while there is none) on the same questions by more
than ``tracking.champion_min_uplift`` and the paired test says the gain is unlikely to be noise
(McNemar's p below ``tracking.champion_alpha``). Otherwise it is registered as ``challenger``, so the
registry's champion is always the best model shown so far. ``decide`` is a pure function of the comparison.

A fixed judge: every version records the evaluation set it was judged on (``eval_set_tags``: the data's digest,
the number of questions and the digest of their ids); the challenger and the champion are evaluated on the same
questions, and when they are not the ones the champion was judged on, ``judge_note`` says so.
"""

import hashlib
from dataclasses import dataclass

from grpo_core.records.tags import read_version_tags

CHAMPION, CHALLENGER = "champion", "challenger"
BASE_MODEL = "the base model"  # what a model is compared with while the registry has no champion
TAG_PREFIX = "grpo."
BASE_TAG = "grpo.base_model"  # on the version of the base model (its hub id or directory): no checkpoint made it


@dataclass(frozen=True)
class Promotion:
    alias: str  # CHAMPION or CHALLENGER
    against: str  # what it was compared with, in words ("champion version 3", "the base model")
    uplift: float
    ci_low: float
    ci_high: float
    p_value: float
    questions: int
    reason: str

    @property
    def promoted(self) -> bool:
        return self.alias == CHAMPION

    @classmethod
    def from_tags(cls, tags: dict[str, str], where: str = "the version") -> "Promotion":
        """What ``tags()`` wrote, read back (a re-run finds the version it registered before), typed by
        records/tags.py: RecordError naming ``where`` and the tag when one does not parse."""
        t = read_version_tags(where, tags)
        low, high = t.uplift_ci95 or (0.0, 0.0)
        return cls(
            t.promotion or CHALLENGER,
            t.compared_with or "",
            t.uplift or 0.0,
            low,
            high,
            1.0 if t.uplift_p_value is None else t.uplift_p_value,
            t.questions or 0,
            t.promotion_reason or "",
        )

    def tags(self) -> dict[str, str]:
        """The model version's tags (and the run's): the outcome, the comparison and why."""
        return {
            "grpo.promotion": self.alias,
            "grpo.compared_with": self.against,
            "grpo.uplift": f"{self.uplift:+.6f}",
            "grpo.uplift_ci95": f"[{self.ci_low:+.6f}, {self.ci_high:+.6f}]",
            "grpo.uplift_p_value": f"{self.p_value:.6g}",
            "grpo.questions": str(self.questions),
            "grpo.promotion_reason": self.reason,
        }


def decide(comparison: dict, against: str, min_uplift: float, alpha: float) -> Promotion:
    """``comparison``: ``paired_uplift(opponent, new)``; champion when uplift > min_uplift and p < alpha."""
    d, low, high, p, n = (comparison[k] for k in ("uplift", "ci_low", "ci_high", "p_value", "n"))
    measured = f"uplift {d:+.4f} [{low:+.4f}, {high:+.4f}] over {against} on {n} questions, p = {p:.3g}"
    big_enough, significant = d > min_uplift, p < alpha
    if big_enough and significant:
        alias = CHAMPION
        why = f"above the minimum {min_uplift:+.4f} and p < {alpha:g}: promoted to champion"
    else:
        alias = CHALLENGER
        misses = []
        if not big_enough:
            misses.append(f"not above the minimum {min_uplift:+.4f}")
        if not significant:
            misses.append(f"p not below {alpha:g} (the difference may be noise)")
        stays = "there is no champion yet" if against == BASE_MODEL else "the champion stays"
        why = f"{' and '.join(misses)}: registered as challenger, {stays}"
    return Promotion(alias, against, d, low, high, p, n, f"{measured}; {why}")


EVAL_DATA_TAG, EVAL_QUESTIONS_TAG, EVAL_IDS_TAG = "grpo.eval_data_digest", "grpo.eval.questions", "grpo.eval.ids_sha256"


def eval_set_tags(eval_set: dict) -> dict[str, str]:
    """An evaluation set (``eval_set.json``: the data's ``dataset_digest`` and the questions' row ids) as a version's
    tags: the question ids themselves are too many for a tag, and sit in the run's ``eval/trained/eval_set.json``."""
    ids = eval_set["questions"]
    return {
        EVAL_DATA_TAG: eval_set["data_digest"],
        EVAL_QUESTIONS_TAG: str(len(ids)),
        EVAL_IDS_TAG: hashlib.sha256("\n".join(ids).encode()).hexdigest(),
    }


def judge_note(champion_tags: dict[str, str], now: dict[str, str], against: str) -> str:
    """Empty when ``against`` (a champion version, its tags ``champion_tags``) was judged on the evaluation set
    ``now`` (``eval_set_tags``); else the sentence that says the set changed: the champion was then evaluated
    again on the new set, and the comparison is on that set alone."""
    then = {key: champion_tags.get(key) for key in now}
    if then == now:
        return ""
    if then[EVAL_DATA_TAG] is None:
        return (
            f"{against} records no evaluation set; it was evaluated on this one ({now[EVAL_QUESTIONS_TAG]} questions)"
        )
    return (
        f"the evaluation set changed since {against} was judged ({then[EVAL_QUESTIONS_TAG]} questions of data "
        f"digest {then[EVAL_DATA_TAG][:12]} then, {now[EVAL_QUESTIONS_TAG]} of {now[EVAL_DATA_TAG][:12]} now); it "
        "was evaluated again on the new set"
    )
