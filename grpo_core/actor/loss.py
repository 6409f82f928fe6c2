"""The actor's GRPO loss for one micro-batch: clipped policy loss + KL loss - entropy bonus.

Returned as (sum, denominator). The actor divides each sum by the denominators summed over the mini-batch's
micro-batches and data-parallel ranks before the backward (megatron's ``calculate_per_token_loss``, with the
division moved from the gradients to the loss), so the update equals one pass over the whole mini-batch
however it is split across micro-batches, DP ranks and PP stages.
"""

from dataclasses import dataclass

import torch

from grpo_core.algos import agg_denominator, agg_loss, compute_policy_loss, kl_penalty


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

    @classmethod
    def from_actor_config(cls, actor) -> "LossSettings":
        return cls(**{name: getattr(actor, name) for name in cls.__dataclass_fields__})


def grpo_loss(
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_log_prob: torch.Tensor | None,
    s: LossSettings,
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """All tensors [b, R]. Returns (loss sum, denominator, metric sums weighted by the denominator)."""
    mask = response_mask.to(log_prob.dtype)
    mode = s.loss_agg_mode
    pg, pg_metrics = compute_policy_loss(
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
    )
    total = pg
    metrics = {"actor/pg_loss": pg.detach()}
    if s.use_kl_loss:
        kl = agg_loss(kl_penalty(log_prob, ref_log_prob, s.kl_loss_type), mask, mode, denominator=1.0)
        total = total + s.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.detach()
    if entropy is not None:
        ent = agg_loss(entropy, mask, mode, denominator=1.0)
        if s.entropy_coeff:
            total = total - s.entropy_coeff * ent
        metrics["actor/entropy"] = ent.detach()
    denominator = agg_denominator(mask, mode)
    for name, value in pg_metrics.items():  # masked means: weight them so they average correctly
        metrics[f"actor/{name}"] = value * denominator
    return total, denominator, metrics
