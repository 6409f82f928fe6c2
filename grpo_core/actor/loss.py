"""The actor's GRPO loss for one micro-batch: policy loss (``policy_loss.loss_mode``, optionally weighted by
rollout importance weights) + KL loss - entropy bonus.

Returned as (sum, denominator). The actor divides each sum by the denominators summed over the mini-batch's
micro-batches and data-parallel ranks before the backward (megatron's ``calculate_per_token_loss``, with the
division moved from the gradients to the loss), so the update equals one pass over the whole mini-batch
however it is split across micro-batches, DP ranks and PP stages.
"""

import inspect
from dataclasses import asdict, dataclass, fields
from functools import cache

import torch

from grpo_core.algos import agg_denominator, agg_loss, get_policy_loss, kl_penalty, rollout_is_weights
from grpo_core.algos.settings import SECTIONS, SETTING, schema_defaults
from grpo_core.config.defaults import section_values


@dataclass(frozen=True)
@schema_defaults
class LossSettings:
    """The loss's settings, verl's names; each defaults to the schema's setting of its name, found in the sections
    the losses take theirs from (algos/settings.py: ``actor``, its ``policy_loss``, ``rollout_correction``)."""

    clip_ratio: float = SETTING
    clip_ratio_low: float | None = SETTING
    clip_ratio_high: float | None = SETTING
    clip_ratio_c: float = SETTING
    loss_agg_mode: str = SETTING
    use_kl_loss: bool = SETTING
    kl_loss_coef: float = SETTING
    kl_loss_type: str = SETTING
    entropy_coeff: float = SETTING
    # Dr.GRPO's constant C (seq-mean-token-sum-norm): one number for every micro-batch, so the update does not
    # depend on how the mini-batch is split; None falls back to the loss mask's width (see ``agg_loss``)
    loss_scale_factor: float | None = SETTING
    loss_mode: str = SETTING  # policy_loss.loss_mode: any name in algos.POLICY_LOSSES
    # the losses' own settings: SAPO's gates (actor.tau_*), actor.policy_loss.*
    tau_pos: float = SETTING
    tau_neg: float = SETTING
    clip_cov_ratio: float = SETTING
    clip_cov_lb: float = SETTING
    clip_cov_ub: float = SETTING
    kl_cov_ratio: float = SETTING
    ppo_kl_coef: float = SETTING
    dro_beta: float | None = SETTING
    rollout_is: str | None = SETTING  # algorithm.rollout_correction.rollout_is: token, sequence or None (off)
    rollout_is_threshold: float | str = SETTING  # a number (truncation) or "lower_upper" (IcePop)
    # the rest of algorithm.rollout_correction, which bypass_mode's loss reads (decoupled mode: the trainer applies
    # rejection and batch normalisation to the whole batch before the update)
    rollout_is_batch_normalize: bool = SETTING
    rollout_rs: str | None = SETTING
    rollout_rs_threshold: float | str | None = SETTING
    loss_type: str = SETTING

    @classmethod
    def from_config(cls, cfg) -> "LossSettings":
        """Each setting of the same name in the config's sections; C is ``actor.loss_scale_factor``, else
        ``data.max_response_length``; the loss is bypass_mode's with ``rollout_correction.bypass_mode``."""
        by_name = section_values(cfg, [f.name for f in fields(cls)], SECTIONS)
        scale = by_name["loss_scale_factor"]
        mapped = {
            "loss_scale_factor": float(cfg.data.max_response_length if scale is None else scale),
            "loss_mode": "bypass_mode" if cfg.algorithm.rollout_correction.bypass_mode else by_name["loss_mode"],
        }
        return cls(**by_name | mapped)


PG_METRICS = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
"""The policy-loss metrics every micro-batch reports (the actor sums one fixed vector of them over micro-batches)."""


@cache
def _parameters(loss_mode: str) -> frozenset[str]:
    return frozenset(inspect.signature(get_policy_loss(loss_mode)).parameters)


def loss_settings(s: LossSettings) -> dict:
    """The settings the chosen policy loss takes, by keyword: each loss names only those it uses (SAPO has no
    clip ratio, DRO only its beta), so a loss never silently receives one it ignores."""
    wanted = _parameters(s.loss_mode)
    return {name: value for name, value in asdict(s).items() if name in wanted}


def grpo_loss(
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ref_log_prob: torch.Tensor | None,
    s: LossSettings,
    rollout_log_prob: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """All tensors [b, R]. Returns (loss sum, denominator, metric sums weighted by the denominator).
    ``rollout_log_prob`` (the engine's log-probs of the sampled tokens) is needed with ``s.rollout_is``; its
    weights need only this micro-batch's rows, each whole (the actor never splits a row), unless ``is_weights``
    gives them (computed by the trainer over the whole batch: ``rollout_is_batch_normalize``). bypass_mode's loss
    computes its own from ``old_log_prob``, the engine's."""
    mask = response_mask.to(log_prob.dtype)
    mode = s.loss_agg_mode
    weights = is_weights
    if weights is None and s.rollout_is is not None and s.loss_mode != "bypass_mode":
        if rollout_log_prob is None:
            raise ValueError("rollout_correction.rollout_is needs the rollout engine's log-probs (rollout_log_probs)")
        weights = rollout_is_weights(old_log_prob, rollout_log_prob, mask, s.rollout_is, s.rollout_is_threshold)
    pg, pg_metrics = get_policy_loss(s.loss_mode)(
        old_log_prob,
        log_prob,
        advantages,
        mask,
        denominator=1.0,
        rollout_is_weights=weights,
        **loss_settings(s),
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
    for name in PG_METRICS:  # masked means: weight them so they average correctly
        value = pg_metrics.get(name)  # a loss without a clip (gpg, dro, kl_cov, ...) reports 0 clipped
        metrics[f"actor/{name}"] = denominator * (0.0 if value is None else value)
    return total, denominator, metrics
