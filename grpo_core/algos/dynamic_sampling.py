"""DAPO's dynamic sampling (Yu et al. 2025; verl's ``algorithm.filter_groups``): a prompt group whose responses
all earn the same reward has advantage 0 for every response, so it is dropped and more prompt batches are drawn
until the step has ``data.train_batch_size`` groups that do teach something.

Pure functions of the scores; the loop draws the batches and calls them.
"""

from collections.abc import Sequence

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""``filter_groups.metric``: ``acc`` (the response earned the full score), ``score`` / ``seq_reward`` (the rule
reward), ``seq_final_reward`` (the reward after shaping, e.g. DAPO's overlong penalty): verl's names."""


def filter_metric_values(
    metric: str, scores: Sequence[float], shaped_scores: Sequence[float], full_score: float
) -> list[float]:
    """Each response's value of ``metric``, from its rule score and its shaped score."""
    if metric == "acc":
        return [float(s >= full_score) for s in scores]
    if metric in ("score", "seq_reward"):
        return [float(s) for s in scores]
    if metric == "seq_final_reward":
        return [float(s) for s in shaped_scores]
    raise ValueError(f"unknown filter_groups.metric {metric!r}; valid: {list(FILTER_METRICS)}")


def groups_with_spread(values: Sequence[float], group_index: Sequence[int]) -> list[int]:
    """The groups, in order of first appearance, whose values are not all equal. A group of one response has
    no peer to differ from and is kept, as verl keeps it (its std is undefined, not 0)."""
    groups: dict[int, list[float]] = {}
    for value, group in zip(values, group_index, strict=True):
        groups.setdefault(group, []).append(value)
    return [g for g, vals in groups.items() if len(vals) == 1 or len(set(vals)) > 1]


def draw_again(kept: int, wanted: int, drawn: int, max_num_gen_batches: int) -> bool:
    """Whether to draw another prompt batch: fewer than ``wanted`` groups kept and the budget of batches
    (``max_num_gen_batches``; 0: no limit) not spent."""
    return kept < wanted and (max_num_gen_batches <= 0 or drawn < max_num_gen_batches)


def trainable_groups(kept: int, n: int, dp: int) -> int:
    """The most of ``kept`` groups of ``n`` responses whose rows split evenly over ``dp`` data-parallel ranks
    (a short step trains on what was kept, less the few groups that do not divide)."""
    while kept > 0 and (kept * n) % dp:
        kept -= 1
    return kept
