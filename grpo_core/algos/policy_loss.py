"""Policy-gradient losses (verl's ``policy_loss.loss_mode``): the loss aggregation modes, the registry, PPO's
clipped loss and GSPO. The rest of verl's losses are in policy_loss_family.py.

Losses live in a name -> function registry like the advantage estimators; each is called like
``compute_policy_loss`` and returns (scalar loss, metrics of 0-dim detached tensors). Each takes the same four
tensors, then its settings as keywords named like verl's config keys (actor.clip_ratio*, actor.tau_pos/tau_neg,
actor.policy_loss.*, algorithm.rollout_correction.*) whose defaults are the schema's (``SETTING``: see
algos/settings.py); ``denominator``, ``loss_scale_factor`` and ``rollout_is_weights`` as ``compute_policy_loss``.
The actor passes each loss only the settings it names.
"""

from collections.abc import Callable

import torch

from grpo_core.algos.settings import SETTING, schema_defaults

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a [batch, T] per-token loss to a scalar.

    token-mean: token sum / token count. seq-mean-token-sum: mean over rows of each row's token sum.
    seq-mean-token-mean: mean over rows of each row's token mean. seq-mean-token-sum-norm (Dr.GRPO): mean
    over rows of each row's token sum / C, with C = ``loss_scale_factor`` a constant (the trainer passes
    verl's ``loss_scale_factor`` or ``data.max_response_length``), so no sequence is weighted by its own
    length; without one it falls back to the mask width, which is only constant if every call has the same.

    ``denominator`` replaces the local normaliser (the token count or the non-empty row count,
    ``agg_denominator``) so summing the results over micro-batches/ranks with the global normaliser gives the
    whole-batch aggregate. Empty rows add nothing and are not counted as rows, so they never make NaN.
    """
    _check_mode(loss_agg_mode)
    masked = loss_mat * loss_mask
    if loss_agg_mode == "token-mean":
        total = masked.sum()
    else:
        row_sums = masked.sum(dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            row_sums = row_sums / loss_mask.sum(dim=-1).clamp(min=1)
        total = row_sums.sum()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            total = total / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return total / (_count(loss_mask, loss_agg_mode).clamp(min=1) if denominator is None else denominator)


def agg_denominator(loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """The normaliser ``agg_loss`` divides by for this mask: its token count for token-mean, its non-empty
    row count for every seq-mean mode (Dr.GRPO's constant is a factor of each row, not a normaliser).

    Summed over micro-batches and data-parallel ranks it is the global normaliser, which makes the
    aggregate independent of how a mini-batch is split. A 0-dim tensor on the mask's device: the update scales each
    micro-batch's loss by its inverse on the GPU, never reading it on the host."""
    _check_mode(loss_agg_mode)
    return _count(loss_mask, loss_agg_mode)


def _count(loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Tokens (token-mean) or non-empty rows (the seq-mean modes), as a tensor: no host sync."""
    return loss_mask.sum() if loss_agg_mode == "token-mean" else (loss_mask.sum(dim=-1) > 0).sum()


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {list(LOSS_AGG_MODES)}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the mask's tokens, detached: a metric."""
    return ((values * mask).sum() / mask.sum().clamp(min=1)).detach()


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding a loss under ``name``, its ``SETTING`` keywords given the schema's defaults; a taken name
    is an error, not a silent override."""

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss_mode {name!r} is already registered")
        POLICY_LOSSES[name] = schema_defaults(fn)
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss_mode {name!r}; valid: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def clip_bounds(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None) -> tuple[float, float]:
    """(low, high) clip epsilons: each side's own, else the symmetric ``clip_ratio``."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def weighted(losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """Each token's loss times its (detached) rollout importance weight, when rollout correction is on."""
    return losses if rollout_is_weights is None else losses * rollout_is_weights.detach()


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = SETTING,
    clip_ratio_low: float | None = SETTING,
    clip_ratio_high: float | None = SETTING,
    clip_ratio_c: float = SETTING,
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss with clip-higher bounds and dual clip; all inputs [batch, response_len].

    The ratio is clipped to [1 - low, 1 + high]; for negative advantages the loss is further capped at
    -A * clip_ratio_c, so one token whose probability exploded cannot dominate the batch.
    Returns (scalar loss, metrics of 0-dim detached tensors: pg_clipfrac, ppo_kl, pg_clipfrac_lower).
    ``denominator`` and ``loss_scale_factor`` are passed to ``agg_loss`` (a global normaliser for
    micro-batched training; Dr.GRPO's constant). ``rollout_is_weights`` [batch, response_len] multiply each
    token's loss (truncated importance sampling against the rollout engine, ``rollout_correction``).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0, got {clip_ratio_c}")
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)

    neg_kl = (log_prob - old_log_prob).clamp(-20, 20)  # clamp keeps exp() finite
    ratio = neg_kl.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    negative = advantages < 0
    losses = torch.where(negative, torch.minimum(clipped, loss3), clipped)

    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    metrics = {
        "pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask),
        "ppo_kl": masked_mean(-neg_kl, response_mask),
        "pg_clipfrac_lower": masked_mean(((clipped > loss3) & negative).float(), response_mask),
    }
    return pg_loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = SETTING,
    clip_ratio_low: float | None = SETTING,
    clip_ratio_high: float | None = SETTING,
    clip_ratio_c: float = SETTING,
    loss_agg_mode: str = "seq-mean-token-mean",  # verl recommends it for GSPO
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, s = exp(mean over its valid tokens of
    log pi - log pi_old), so a single token's noise cannot clip (or not) on its own. Each token carries
    s * pi / sg(pi): its value is s, its gradient flows through that token's log-prob. The log-ratio is clamped
    at 10; loss = max(-A s, -A clip(s, 1 - low, 1 + high)); no dual clip (``clip_ratio_c`` is unused).
    Needs each sequence whole in one call (the actor never splits a row over micro-batches). Arguments and
    metrics as ``compute_policy_loss`` (pg_clipfrac_lower is 0); verl recommends seq-mean-token-mean.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    neg_kl = log_prob - old_log_prob
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_neg_kl = (neg_kl * response_mask).sum(dim=-1) / lengths
    log_ratio = (log_prob - log_prob.detach() + seq_neg_kl.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = log_ratio.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - low, 1 + high)
    losses = torch.maximum(loss1, loss2)

    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    metrics = {
        "pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask),
        "ppo_kl": masked_mean(-neg_kl, response_mask),
        "pg_clipfrac_lower": torch.zeros((), device=log_prob.device),
    }
    return pg_loss, metrics
