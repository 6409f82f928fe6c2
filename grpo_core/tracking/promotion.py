"""Champion or challenger: does a newly trained model replace the registry's ``champion``?

Only when it beats the current champion (the base model while there is none) on the same questions by more
than ``tracking.champion_min_uplift`` and the paired test says the gain is unlikely to be noise
(McNemar's p below ``tracking.champion_alpha``). Otherwise it is registered as ``challenger``, so the
registry's champion is always the best model shown so far. ``decide`` is a pure function of the comparison.
"""

from dataclasses import dataclass

CHAMPION, CHALLENGER = "champion", "challenger"
BASE_MODEL = "the base model"  # what a model is compared with while the registry has no champion
TAG_PREFIX = "grpo."


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
    def from_tags(cls, tags: dict[str, str]) -> "Promotion":
        """What ``tags()`` wrote, read back (a re-run finds the version it registered before)."""
        low, high = (float(x) for x in tags.get("grpo.uplift_ci95", "[0, 0]").strip("[]").split(","))
        return cls(
            tags.get("grpo.promotion", CHALLENGER),
            tags.get("grpo.compared_with", ""),
            float(tags.get("grpo.uplift", 0)),
            low,
            high,
            float(tags.get("grpo.uplift_p_value", 1)),
            int(tags.get("grpo.questions", 0)),
            tags.get("grpo.promotion_reason", ""),
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
