"""Rule-based rewards, looked up by a dataset row's ``data_source``."""

from collections.abc import Callable

from grpo_core.rewards import capitals, gsm8k

RewardFn = Callable[..., float]

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
