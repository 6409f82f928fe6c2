"""Core RL math for GRPO: advantage estimators, KL penalties, policy loss and loss aggregation."""

from grpo_core.algos.advantage import (
    ADV_ESTIMATORS,
    compute_grpo_outcome_advantage,
    get_adv_estimator,
    register_adv_estimator,
)
from grpo_core.algos.kl import KL_PENALTY_TYPES, kl_penalty
from grpo_core.algos.policy_loss import LOSS_AGG_MODES, agg_denominator, agg_loss, compute_policy_loss
from grpo_core.algos.shaping import overlong_penalty

__all__ = [
    "ADV_ESTIMATORS",
    "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES",
    "agg_denominator",
    "agg_loss",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "get_adv_estimator",
    "kl_penalty",
    "overlong_penalty",
    "register_adv_estimator",
]
