"""The actor's GRPO loss for one micro-batch: policy loss (``policy_loss.loss_mode``, optionally weighted by
rollout importance weights) + KL loss - entropy bonus.

Returned as (sum, denominator). The actor divides each sum by the denominators summed over the mini-batch's
micro-batches and data-parallel ranks before the backward (megatron's ``calculate_per_token_loss``, with the
division moved from the gradients to the loss), so the update equals one pass over the whole mini-batch
however it is split across micro-batches, DP ranks and PP stages.
"""

from dataclasses import dataclass

import torch

from grpo_core.algos import agg_denominator, agg_loss, get_policy_loss, kl_penalty, rollout_is_weights


@dataclass(frozen=True)
class LossSettings:
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    # Dr.GRPO's constant C (seq-mean-token-sum-norm): one number for every micro-batch, so the update does not
    # depend on how the mini-batch is split; None falls back to the loss mask's width (see ``agg_loss``)
    loss_scale_factor: float | None = None
    loss_mode: str = "vanilla"  # policy_loss.loss_mode: vanilla or gspo
    rollout_is: str | None = None  # algorithm.rollout_correction.rollout_is: token, sequence or None (off)
    rollout_is_threshold: float = 2.0

    @classmethod
    def from_config(cls, cfg) -> "LossSettings":
        """From ``actor_rollout_ref.actor``; C is its ``loss_scale_factor``, else ``data.max_response_length``;
        the policy loss from its ``policy_loss``; rollout importance sampling from ``algorithm.rollout_correction``."""
        actor, correction = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
        elsewhere = ("loss_scale_factor", "loss_mode", "rollout_is", "rollout_is_threshold")
        settings = {name: getattr(actor, name) for name in cls.__dataclass_fields__ if name not in elsewhere}
        scale = actor.loss_scale_factor
        return cls(
            **settings,
            loss_scale_factor=float(cfg.data.max_response_length if scale is None else scale),
            loss_mode=actor.policy_loss.loss_mode,
            rollout_is=correction.rollout_is,
            rollout_is_threshold=correction.rollout_is_threshold,
        )


def grpo_loss(
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_log_prob: torch.Tensor | None,
    s: LossSettings,
    rollout_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """All tensors [b, R]. Returns (loss sum, denominator, metric sums weighted by the denominator).
    ``rollout_log_prob`` (the engine's log-probs of the sampled tokens) is needed with ``s.rollout_is``; its
    weights need only this micro-batch's rows, each whole (the actor never splits a row)."""
    mask = response_mask.to(log_prob.dtype)
    mode = s.loss_agg_mode
    weights = None
    if s.rollout_is is not None:
        if rollout_log_prob is None:
            raise ValueError("rollout_correction.rollout_is needs the rollout engine's log-probs (rollout_log_probs)")
        weights = rollout_is_weights(old_log_prob, rollout_log_prob, mask, s.rollout_is, s.rollout_is_threshold)
    pg, pg_metrics = get_policy_loss(s.loss_mode)(
        old_log_prob,
        log_prob,
        advantages,
        mask,
        s.clip_ratio,
        s.clip_ratio_low,
        s.clip_ratio_high,
        s.clip_ratio_c,
        mode,
        denominator=1.0,
        loss_scale_factor=s.loss_scale_factor,
        rollout_is_weights=weights,
    )
    total = pg
    metrics = {"actor/pg_loss": pg.detach()}
    if s.use_kl_loss:
        kl_mat = kl_penalty(log_prob, ref_log_prob, s.kl_loss_type)
        kl = agg_loss(kl_mat, mask, mode, denominator=1.0, loss_scale_factor=s.loss_scale_factor)
        total = total + s.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.detach()
    if entropy is not None:
        ent = agg_loss(entropy, mask, mode, denominator=1.0, loss_scale_factor=s.loss_scale_factor)
        if s.entropy_coeff:
            total = total - s.entropy_coeff * ent
        metrics["actor/entropy"] = ent.detach()
    denominator = agg_denominator(mask, mode)
    for name, value in pg_metrics.items():  # masked means: weight them so they average correctly
        metrics[f"actor/{name}"] = value * denominator
    return total, denominator, metrics
