"""The uncertainty of an accuracy and of an uplift measured on the same questions.

An uplift people act on (promote a model, keep a schedule) must come with its interval: two accuracies on the
same questions are paired, so the interval of their difference uses the 2x2 table of agreements, not two
independent samples. Pure functions of the per-question records.
"""

from collections.abc import Sequence
from math import sqrt

from scipy.stats import binomtest


def wilson_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of an accuracy ``correct / n`` ((0, 1) when there are no samples)."""
    if n == 0:
        return 0.0, 1.0
    ci = binomtest(correct, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def paired_uplift(base: Sequence[bool], trained: Sequence[bool], confidence: float = 0.95) -> dict[str, float]:
    """trained - base accuracy on the same questions, with Newcombe's (1998) method-10 interval and the exact
    McNemar p-value.

    Method 10 combines each accuracy's Wilson interval through the phi correlation of the paired 2x2 table,
    its numerator ad - bc reduced by n/2 towards 0 when positive, as Newcombe sets it (phi = 0 when a margin
    is empty). McNemar's exact test is a two-sided binomial test of the discordant
    pairs (questions only one of the two models gets right); with none, the p-value is 1.
    """
    if len(base) != len(trained):
        raise ValueError(f"paired records differ in length: {len(base)} base vs {len(trained)} trained")
    n = len(base)
    both = sum(b and t for b, t in zip(base, trained, strict=True))
    only_trained = sum(t and not b for b, t in zip(base, trained, strict=True))
    only_base = sum(b and not t for b, t in zip(base, trained, strict=True))
    neither = n - both - only_trained - only_base
    cells = {"both": both, "only_trained": only_trained, "only_base": only_base, "neither": neither, "n": n}
    if n == 0:
        return {"uplift": 0.0, "ci_low": -1.0, "ci_high": 1.0, "p_value": 1.0, **cells}

    p1, p2 = (both + only_trained) / n, (both + only_base) / n  # trained, base
    l1, u1 = wilson_interval(both + only_trained, n, confidence)
    l2, u2 = wilson_interval(both + only_base, n, confidence)
    margins = (both + only_trained) * (only_base + neither) * (both + only_base) * (only_trained + neither)
    cross = both * neither - only_trained * only_base
    if cross > 0:
        cross = max(cross - n / 2, 0.0)
    phi = cross / sqrt(margins) if margins else 0.0
    d = p1 - p2
    delta = sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    epsilon = sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))

    discordant = only_trained + only_base
    p_value = binomtest(min(only_trained, only_base), discordant, 0.5).pvalue if discordant else 1.0
    return {"uplift": d, "ci_low": d - delta, "ci_high": d + epsilon, "p_value": float(min(p_value, 1.0)), **cells}


def _signed(x: float) -> str:
    """``+0.031`` / ``−0.012`` (a real minus sign, so the columns of signed numbers line up)."""
    return f"{x:+.3f}".replace("-", "\N{MINUS SIGN}")


def format_p(p_value: float) -> str:
    return "p < 0.001" if p_value < 0.001 else f"p = {p_value:.3f}" if p_value < 0.01 else f"p = {p_value:.2f}"


def format_uplift(result: dict, unit: str = "question") -> str:
    """A paired uplift as people read it everywhere (report, CLI, ``grpo compare``):
    ``+0.031 [−0.012, +0.074], p = 0.17, 1,319 questions``. ``result`` has paired_uplift's keys."""
    n = int(result["n"])
    interval = f"[{_signed(result['ci_low'])}, {_signed(result['ci_high'])}]"
    return f"{_signed(result['uplift'])} {interval}, {format_p(result['p_value'])}, {n:,} {unit}{'' if n == 1 else 's'}"


def format_rate(correct: int, n: int, unit: str = "question") -> str:
    """A proportion with its Wilson interval and sample count: ``0.250 [0.102, 0.495], 16 questions``."""
    low, high = wilson_interval(correct, n)
    value = correct / n if n else 0.0
    return f"{value:.3f} [{low:.3f}, {high:.3f}], {n:,} {unit}{'' if n == 1 else 's'}"


def mean_difference(
    before: tuple[float, float, int], after: tuple[float, float, int], confidence: float = 0.95
) -> dict:
    """after - before of two independent means, each given as (mean, standard deviation, count): the normal
    (Welch) interval and two-sided p-value, with paired_uplift's keys (``n``: the smaller count). For a per-step
    mean like the training reward, whose samples differ from step to step."""
    from scipy.stats import norm

    (m1, s1, n1), (m2, s2, n2) = before, after
    d = m2 - m1
    se = sqrt((s1**2 / n1 if n1 else 0.0) + (s2**2 / n2 if n2 else 0.0))
    if se == 0:
        return {"uplift": d, "ci_low": d, "ci_high": d, "p_value": 1.0 if d == 0 else 0.0, "n": min(n1, n2)}
    z = float(norm.ppf(0.5 + confidence / 2))
    p = float(2 * norm.sf(abs(d) / se))
    return {"uplift": d, "ci_low": d - z * se, "ci_high": d + z * se, "p_value": p, "n": min(n1, n2)}


def verdict(result: dict) -> str:
    """In words: did it move? Only when the interval excludes 0."""
    if result["ci_low"] > 0:
        return "rose"
    if result["ci_high"] < 0:
        return "fell"
    return "no significant change (the interval holds 0)"
