"""Rule-based rewards, looked up by a dataset row's ``data_source``, or the user's own function."""

from collections.abc import Callable

from grpo_core.rewards import capitals, gsm8k
from grpo_core.rewards.custom import as_score, load_custom_reward

RewardFn = Callable[..., float]
Scorer = Callable[[str, str, str, dict | None], float]
"""(data_source, solution_str, ground_truth, extra_info) -> reward: what the trainer calls per response."""

REWARDS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "synthetic/capitals": capitals.compute_score,
}


def get_reward_fn(data_source: str) -> RewardFn:
    """The scoring function for a data source; unknown sources fail with the known list."""
    try:
        return REWARDS[data_source]
    except KeyError:
        raise ValueError(f"no reward for data_source {data_source!r}; known: {sorted(REWARDS)}") from None


def build_scorer(cfg) -> Scorer:
    """``custom_reward_function.path``'s function when set (verl's keyword call), else the built-in reward
    of each row's data_source with ``reward_model``'s method and scores."""
    custom = cfg.custom_reward_function
    if custom.path:
        fn = load_custom_reward(custom.path, custom.name)

        def score_custom(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float:
            result = fn(
                data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
            )
            return as_score(result, custom.name)

        return score_custom
    rm = cfg.reward_model

    def score_builtin(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float:
        fn = get_reward_fn(data_source)
        return fn(solution_str, ground_truth, method=rm.method, format_score=rm.format_score, score=rm.score)

    return score_builtin


def reward_name(cfg, data_source: str) -> str:
    """The function that scores ``data_source``'s responses, in words (for an error about its value)."""
    custom = cfg.custom_reward_function
    if custom.path:
        return f"custom_reward_function {custom.path}:{custom.name}"
    return f"the built-in reward of data_source {data_source!r}"
