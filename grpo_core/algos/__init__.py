"""Core RL math for GRPO and its family: advantage estimators, KL penalties, policy losses, loss aggregation,
reward shaping, dynamic sampling and rollout importance sampling."""

from grpo_core.algos.advantage import (
    ADV_ESTIMATORS,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    register_adv_estimator,
)
from grpo_core.algos.dynamic_sampling import (
    FILTER_METRICS,
    draw_again,
    filter_metric_values,
    groups_with_spread,
    trainable_groups,
)
from grpo_core.algos.kl import KL_PENALTY_TYPES, kl_penalty
from grpo_core.algos.policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_denominator,
    agg_loss,
    compute_policy_loss,
    compute_policy_loss_gspo,
    get_policy_loss,
    register_policy_loss,
)
from grpo_core.algos.policy_loss_family import BYPASS_LOSS_TYPES  # and registers the rest of verl's losses
from grpo_core.algos.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_OPTIONS,
    parse_is_threshold,
    parse_rs,
    rollout_corr_metrics,
    rollout_is_metrics,
    rollout_is_weights,
    rollout_rejection_mask,
)
from grpo_core.algos.shaping import overlong_penalty

__all__ = [
    "ADV_ESTIMATORS",
    "FILTER_METRICS",
    "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "BYPASS_LOSS_TYPES",
    "agg_denominator",
    "agg_loss",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_gspo",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "draw_again",
    "filter_metric_values",
    "get_adv_estimator",
    "get_policy_loss",
    "groups_with_spread",
    "kl_penalty",
    "overlong_penalty",
    "parse_is_threshold",
    "parse_rs",
    "rollout_corr_metrics",
    "rollout_rejection_mask",
    "register_adv_estimator",
    "register_policy_loss",
    "rollout_is_metrics",
    "rollout_is_weights",
    "trainable_groups",
]
