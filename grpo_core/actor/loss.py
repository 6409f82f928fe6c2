"""The actor's GRPO loss for one micro-batch: policy loss (``policy_loss.loss_mode``, optionally weighted by
rollout importance weights) + KL loss - entropy bonus.

Returned as (sum, denominator). The actor divides each sum by the denominators summed over the mini-batch's
micro-batches and data-parallel ranks before the backward (megatron's ``calculate_per_token_loss``, with the
division moved from the gradients to the loss), so the update equals one pass over the whole mini-batch
however it is split across micro-batches, DP ranks and PP stages.
"""

import inspect
from dataclasses import asdict, dataclass
from functools import cache

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
    loss_mode: str = "vanilla"  # policy_loss.loss_mode: any name in algos.POLICY_LOSSES
    # the losses' own settings, verl's names and defaults: SAPO's gates (actor.tau_*), actor.policy_loss.*
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    rollout_is: str | None = None  # algorithm.rollout_correction.rollout_is: token, sequence or None (off)
    rollout_is_threshold: float | str = 2.0  # a number (truncation) or "lower_upper" (IcePop)
    # the rest of algorithm.rollout_correction, which bypass_mode's loss reads (decoupled mode: the trainer applies
    # rejection and batch normalisation to the whole batch before the update)
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    loss_type: str = "ppo_clip"

    @classmethod
    def from_config(cls, cfg) -> "LossSettings":
        """From ``actor_rollout_ref.actor``; C is its ``loss_scale_factor``, else ``data.max_response_length``;
        the policy loss from its ``policy_loss``; rollout importance sampling from ``algorithm.rollout_correction``."""
        actor, correction = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
        elsewhere = ("loss_scale_factor", "loss_mode", *POLICY_LOSS_KEYS, *ROLLOUT_CORRECTION_KEYS)
        settings = {name: getattr(actor, name) for name in cls.__dataclass_fields__ if name not in elsewhere}
        scale = actor.loss_scale_factor
        return cls(
            **settings,
            loss_scale_factor=float(cfg.data.max_response_length if scale is None else scale),
            loss_mode="bypass_mode" if correction.bypass_mode else actor.policy_loss.loss_mode,
            **{name: getattr(actor.policy_loss, name) for name in POLICY_LOSS_KEYS},
            **{name: getattr(correction, name) for name in ROLLOUT_CORRECTION_KEYS},
        )


POLICY_LOSS_KEYS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")
ROLLOUT_CORRECTION_KEYS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "loss_type",
)
"""LossSettings fields read from actor.policy_loss and from algorithm.rollout_correction (the others: actor)."""


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
