"""The step's learning signal, pure functions of the batch and the config: each response token's advantage
(``algorithm.adv_estimator`` over the outcome rewards, less a KL penalty in the reward), and the correction of the
mismatch between the rollout engine and the old policy (``algorithm.rollout_correction``).
"""

from dataclasses import replace

import torch

from grpo_core.algos import (
    get_adv_estimator,
    kl_penalty,
    rollout_corr_metrics,
    rollout_is_weights,
    rollout_rejection_mask,
)
from grpo_core.config import GRPOConfig
from grpo_core.data.batch import RolloutBatch


def advantages(
    scores: list[float],
    batch: RolloutBatch,
    group_index: list[int],
    cfg: GRPOConfig,
    baselines: list[float] | None = None,
) -> torch.Tensor:
    """Each response token's advantage, [B, R]: ``algorithm.adv_estimator`` over the outcome rewards (``scores`` on
    the last tokens), less the KL penalty with ``algorithm.use_kl_in_reward``. ``baselines``: remax's, one per
    prompt."""
    token_rewards = token_level_rewards(scores, batch.response_mask)
    if cfg.algorithm.use_kl_in_reward:
        kl = kl_penalty(batch.old_log_probs, batch.ref_log_probs, cfg.algorithm.kl_penalty)
        token_rewards = token_rewards - cfg.algorithm.kl_ctrl.kl_coef * kl * batch.response_mask
    options = advantage_options(cfg)
    if baselines is not None:
        options["reward_baselines"] = torch.tensor([baselines[g] for g in group_index], dtype=token_rewards.dtype)
    estimate, _ = get_adv_estimator(cfg.algorithm.adv_estimator)(
        token_rewards, batch.response_mask, index=group_index, **options
    )
    return estimate


def token_level_rewards(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """Each response's score on its last token (outcome reward), zeros elsewhere: [B, R]."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.sum(-1) - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return rewards * response_mask


def advantage_options(cfg: GRPOConfig) -> dict:
    """The keyword options every advantage estimator is called with; each takes those it uses."""
    algo = cfg.algorithm
    return {"norm_adv_by_std_in_grpo": algo.norm_adv_by_std_in_grpo, "gamma": algo.gamma, "lam": algo.lam}


def rollout_correction(batch: RolloutBatch, cfg: GRPOConfig) -> tuple[RolloutBatch, dict[str, float]]:
    """The batch the update trains on, and the rejection metrics (``rollout_corr/rollout_rs_*``). Bypass mode: the
    engine's log-probs are the old policy's (bypass_mode's loss then weighs and rejects per micro-batch, as verl's
    does). Decoupled: rejection sampling drops tokens from the loss mask, and batch-normalised weights are computed
    here over the whole batch (both need every row's old log-probs: the loop's ``_on_policy_rows`` is then 0);
    plain weights are computed per micro-batch by the loss."""
    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode:
        return replace(batch, old_log_probs=batch.rollout_log_probs), {}
    if rc.rollout_rs is None and not (rc.rollout_is is not None and rc.rollout_is_batch_normalize):
        return batch, {}
    old, engine = batch.old_log_probs, batch.rollout_log_probs
    trained, metrics = batch, {}
    if rc.rollout_rs is not None:
        kept, rs_metrics = rollout_rejection_mask(
            old, engine, batch.response_mask, rc.rollout_rs, rc.rollout_rs_threshold
        )
        trained = replace(trained, response_mask=kept)
        metrics = {f"rollout_corr/{k}": v for k, v in rs_metrics.items()}
    if rc.rollout_is is not None and rc.rollout_is_batch_normalize:
        mask = trained.response_mask
        weights = rollout_is_weights(old, engine, mask, rc.rollout_is, rc.rollout_is_threshold, batch_normalize=True)
        trained = replace(trained, rollout_is_weights=weights)
    return trained, metrics


def rollout_corr_step_metrics(batch: RolloutBatch, trained: RolloutBatch, cfg: GRPOConfig) -> dict[str, float]:
    """verl's ``rollout_corr/*`` of the weights the update used (when rollout_is is on) and of the mismatch between
    the engine and the old policy, over the tokens the update trained on; none in bypass mode (old is the engine)."""
    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode or (rc.rollout_is is None and rc.rollout_rs is None) or batch.rollout_log_probs is None:
        return {}
    old, engine, mask = batch.old_log_probs, batch.rollout_log_probs, trained.response_mask
    weights = trained.rollout_is_weights
    if weights is None and rc.rollout_is is not None:
        weights = rollout_is_weights(old, engine, mask, rc.rollout_is, rc.rollout_is_threshold)
    level = rc.rollout_is or "token"
    return rollout_corr_metrics(
        weights,
        old,
        engine,
        mask,
        rc.rollout_is_threshold,
        level,
        rc.rollout_is is not None and rc.rollout_is_batch_normalize,
    )
