"""The rest of verl's policy-gradient losses (``policy_loss.loss_mode``), registered after PPO's and GSPO's
(policy_loss.py), in verl's order: SAPO, CISPO, GMPO, GPG, Clip-Cov, KL-Cov, DPPO, DRO and bypass mode.

Each is called like ``compute_policy_loss``: the same four tensors, then its settings as keywords named like verl's
config keys, defaulting to the schema's (``SETTING``); ``denominator``, ``loss_scale_factor`` and
``rollout_is_weights`` as there. Each returns (scalar loss, metrics of 0-dim detached tensors).
"""

import torch

from grpo_core.algos.policy_loss import (
    agg_denominator,
    agg_loss,
    clip_bounds,
    compute_policy_loss,
    masked_mean,
    register_policy_loss,
    weighted,
)
from grpo_core.algos.rollout_correction import rollout_is_weights as is_weights
from grpo_core.algos.rollout_correction import rollout_rejection_mask
from grpo_core.algos.settings import SETTING


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi - log pi_old clamped to +-20 so exp() stays finite, the ratio)."""
    neg_kl = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    return neg_kl, neg_kl.exp()


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    tau_pos: float = SETTING,
    tau_neg: float = SETTING,
    loss_agg_mode: str = "seq-mean-token-mean",  # SAPO's own: verl always aggregates it so
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): no hard clip; each token's ratio r passes a soft gate
    f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg, and the loss is -f(r) A.
    f'(1) = 1, so on-policy the gradient is the plain policy gradient; it fades smoothly as r leaves 1 (faster
    for negative advantages, tau_neg > tau_pos). verl always aggregates it seq-mean-token-mean; here
    ``loss_agg_mode`` decides (default seq-mean-token-mean) so the actor's normaliser matches its value."""
    neg_kl, ratio = _log_ratio(log_prob, old_log_prob)
    pos, neg = (torch.tensor(t, dtype=ratio.dtype, device=ratio.device) for t in (tau_pos, tau_neg))
    tau = torch.where(advantages > 0, pos, neg)  # tensors, not floats: where() would make them float32
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    losses = -gates * advantages
    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    metrics = {
        "pg_clipfrac": _zero(ratio),
        "ppo_kl": masked_mean(-neg_kl, response_mask),
        "pg_clipfrac_lower": _zero(ratio),
    }
    return pg_loss, metrics


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = SETTING,
    clip_ratio_low: float | None = SETTING,
    clip_ratio_high: float | None = SETTING,
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance-sampling *weight*, not the update: each token's
    loss is -sg(clip(r, 1 - low, 1 + high)) A log pi. Every token keeps a gradient (PPO drops the clipped ones);
    the clipped weight only scales it, and no gradient flows through the weight. pg_clipfrac: share of tokens
    whose weight was clipped."""
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    neg_kl, ratio = _log_ratio(log_prob, old_log_prob)
    weight = ratio.clamp(1 - low, 1 + high)
    losses = -weight.detach() * advantages * log_prob
    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    metrics = {
        "pg_clipfrac": masked_mean((ratio != weight).to(ratio.dtype), response_mask),
        "ppo_kl": masked_mean(-neg_kl, response_mask),
        "pg_clipfrac_lower": _zero(ratio),
    }
    return pg_loss, metrics


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = SETTING,
    clip_ratio_low: float | None = SETTING,
    clip_ratio_high: float | None = SETTING,
    loss_agg_mode: str = "seq-mean-token-mean",  # GMPO's own: a mean of sequence losses, as verl's
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): the geometric mean of the token ratios instead of their
    arithmetic mean, so an outlier token moves the sequence's ratio little. Each token's log-ratio is clipped
    to [-low, high] on the side its sequence's advantage sign makes pessimistic (sgn(A) * min(sgn(A) l,
    sgn(A) clip(l))); the sequence's loss is -A_seq exp(mean of those over its tokens), A_seq its tokens' mean
    advantage. verl takes the mean of the sequence losses whatever ``loss_agg_mode``; here each sequence's loss
    is put on each of its tokens and aggregated by ``loss_agg_mode`` (default seq-mean-token-mean: verl's value
    for non-empty rows), so the actor's normaliser fits. Rollout IS weights enter as their geometric mean per
    sequence. The paper clips at (e^-0.4, e^0.4): clip_ratio=0.4; verl passes actor.clip_ratio (0.2)."""
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_prob.dtype)
    neg_kl = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = neg_kl.clamp(-low, high)
    pessimistic = sign * torch.minimum(sign * neg_kl, sign * clamped)
    lengths = mask.sum(dim=-1).clamp(min=1)
    seq_ratio = ((pessimistic * mask).sum(dim=-1) / lengths).exp()
    seq_adv = (advantages * mask).sum(dim=-1) / lengths
    seq_loss = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach() + 1e-10)
        seq_loss = seq_loss * ((log_w * mask).sum(dim=-1) / lengths).exp()
    losses = seq_loss.unsqueeze(-1).expand_as(log_prob)
    pg_loss = agg_loss(losses, response_mask, loss_agg_mode, denominator, loss_scale_factor)
    clipped = (neg_kl != clamped).to(log_prob.dtype)
    metrics = {
        "pg_clipfrac": masked_mean(clipped * (advantages > 0), response_mask),
        "ppo_kl": masked_mean(-neg_kl, response_mask),
        "pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), response_mask),
    }
    return pg_loss, metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (Chu et al. 2025, arXiv 2504.02546): the plain policy gradient, -A log pi, with no ratio and no clip
    (``old_log_prob`` gives only the ppo_kl metric). Pair it with adv_estimator=gpg."""
    losses = -advantages * log_prob
    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    return pg_loss, {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask)}


def _masked_scalar_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = SETTING,
    clip_ratio_low: float | None = SETTING,
    clip_ratio_high: float | None = SETTING,
    clip_cov_ratio: float = SETTING,
    clip_cov_lb: float = SETTING,
    clip_cov_ub: float = SETTING,
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617): PPO's
    clipped loss, and besides the tokens PPO clips, a few tokens with a high covariance between advantage and
    log-prob, cov = (A - mean A)(log pi - mean log pi) in (clip_cov_lb, clip_cov_ub), lose their gradient
    (their loss is multiplied by 0): max(1, int(clip_cov_ratio * valid tokens)) of them, drawn at random
    (``generator``; torch's global one by default) among the candidates. Means are over this call's valid tokens,
    so the selection is per call (per micro-batch in the actor, as in verl). pg_clipfrac: share detached."""
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    neg_kl = log_prob - old_log_prob
    ratio = neg_kl.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - low, 1 + high)
    valid = response_mask > 0
    with torch.no_grad():
        lp = log_prob.detach()
        cov = (advantages - _masked_scalar_mean(advantages, response_mask)) * (
            lp - _masked_scalar_mean(lp, response_mask)
        )
        candidates = valid & ~(loss2 > loss1) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        picked = torch.nonzero(candidates)
        count = max(int(clip_cov_ratio * int(valid.sum())), 1)
        if len(picked) > count:
            picked = picked[torch.randperm(len(picked), generator=generator)[:count].to(picked.device)]
        keep = torch.ones_like(log_prob)
        keep[picked[:, 0], picked[:, 1]] = 0
    losses = torch.maximum(loss1, loss2) * keep
    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    metrics = {
        "pg_clipfrac": masked_mean((keep == 0).to(log_prob.dtype), response_mask),
        "ppo_kl": masked_mean(-neg_kl, response_mask),
    }
    return pg_loss, metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    kl_cov_ratio: float = SETTING,
    ppo_kl_coef: float = SETTING,
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (same paper as Clip-Cov): the unclipped surrogate -A r on every token, plus a penalty
    ppo_kl_coef * |log r| on the max(1, int(kl_cov_ratio * valid tokens)) valid tokens with the largest
    covariance (A - mean A)(log pi - mean log pi) (means over this call's valid tokens; the selection is computed
    without gradient). ppo_kl: the mean |log r|, as verl logs it."""
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    neg_kl = log_prob - old_log_prob
    abs_kl = neg_kl.abs()
    ratio = neg_kl.exp()
    valid = response_mask > 0
    with torch.no_grad():
        flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        penalised = torch.zeros(log_prob.numel(), dtype=log_prob.dtype, device=log_prob.device)
        if len(flat):
            adv, lp = advantages.reshape(-1)[flat], log_prob.detach().reshape(-1)[flat]
            cov = (adv - adv.mean()) * (lp - lp.mean())
            top = torch.topk(cov, max(1, int(len(flat) * kl_cov_ratio))).indices
            penalised[flat[top]] = 1.0
        penalised = penalised.reshape(log_prob.shape)
    losses = -advantages * ratio + penalised * ppo_kl_coef * abs_kl
    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    return pg_loss, {"ppo_kl": masked_mean(abs_kl, response_mask)}


def _dppo(
    valid: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    ratio: torch.Tensor,
    neg_kl: torch.Tensor,
    clip_ratio_c: float,
    loss_agg_mode: str,
    denominator,
    loss_scale_factor,
    rollout_is_weights,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO's loss once its trust region ``valid`` is known: -A sg(min(r, clip_ratio_c)) log pi on the tokens
    inside it, 0 outside (the ratio truncated at clip_ratio_c instead of the dual clip)."""
    valid = valid.detach().to(log_prob.dtype)
    truncated = ratio.clamp(max=clip_ratio_c).detach()
    losses = -advantages * truncated * log_prob * valid
    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    metrics = {
        "pg_clipfrac": masked_mean(1.0 - valid, response_mask),
        "ppo_kl": masked_mean(-neg_kl, response_mask),
        "pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).to(log_prob.dtype) * valid, response_mask),
    }
    return pg_loss, metrics


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = SETTING,
    clip_ratio_low: float | None = SETTING,
    clip_ratio_high: float | None = SETTING,
    clip_ratio_c: float = 20.0,  # DPPO's own: verl's fallback (the trainer passes actor.clip_ratio_c)
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (arXiv 2602.04879): the trust region is on the probability itself, not the ratio: a token
    with A > 0 is updated while pi - pi_old <= clip_ratio_high, one with A <= 0 while pi - pi_old >= -clip_ratio_low
    (clip_ratio* are total-variation bounds here). The ratio is truncated at clip_ratio_c (the function's default
    20 is verl's fallback; the trainer passes actor.clip_ratio_c, as verl does)."""
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    neg_kl, ratio = _log_ratio(log_prob, old_log_prob)
    diff = log_prob.exp() - old_log_prob.exp()
    valid = torch.where(advantages > 0, diff <= high, diff >= -low)
    return _dppo(
        valid,
        log_prob,
        advantages,
        response_mask,
        ratio,
        neg_kl,
        clip_ratio_c,
        loss_agg_mode,
        denominator,
        loss_scale_factor,
        rollout_is_weights,
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = SETTING,
    clip_ratio_low: float | None = SETTING,
    clip_ratio_high: float | None = SETTING,
    clip_ratio_c: float = 20.0,  # DPPO's own: verl's fallback (the trainer passes actor.clip_ratio_c)
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (arXiv 2602.04879): as dppo_tv with the binary KL between Bernoulli(pi_old) and
    Bernoulli(pi), p log(p/q) + (1-p) log((1-p+1e-8)/(1-q+1e-8)), as the divergence: a token with A > 0 is updated
    while that KL <= clip_ratio_high or pi <= pi_old (moving back), one with A <= 0 while it is <= clip_ratio_low
    or pi >= pi_old."""
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    neg_kl, ratio = _log_ratio(log_prob, old_log_prob)
    p, q = old_log_prob.exp(), log_prob.exp()
    binary_kl = p * (old_log_prob - log_prob) + (1 - p) * torch.log((1.0 - p + 1e-8) / (1.0 - q + 1e-8))
    valid = torch.where(advantages > 0, (binary_kl <= high) | (q <= p), (binary_kl <= low) | (q >= p))
    return _dppo(
        valid,
        log_prob,
        advantages,
        response_mask,
        ratio,
        neg_kl,
        clip_ratio_c,
        loss_agg_mode,
        denominator,
        loss_scale_factor,
        rollout_is_weights,
    )


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    dro_beta: float | None = SETTING,
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO (Direct Reward Optimization, Richemond et al. 2024, arXiv 2405.19107), as verl writes it: the policy
    gradient with a quadratic penalty on the log-ratio, -(A log pi - dro_beta / 2 (log pi - log pi_old)^2).
    ``dro_beta`` (policy_loss.dro_beta) has no default: it must be > 0."""
    if dro_beta is None or dro_beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 with loss_mode=dro, got {dro_beta}")
    log_ratio = log_prob - old_log_prob
    losses = -(log_prob * advantages - 0.5 * dro_beta * log_ratio.square())
    pg_loss = agg_loss(
        weighted(losses, rollout_is_weights), response_mask, loss_agg_mode, denominator, loss_scale_factor
    )
    return pg_loss, {"ppo_kl": masked_mean(-log_ratio, response_mask)}


BYPASS_LOSS_TYPES: tuple[str, ...] = ("ppo_clip", "reinforce")


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_type: str = SETTING,
    rollout_is: str | None = SETTING,
    rollout_is_threshold: float | str = SETTING,
    rollout_is_batch_normalize: bool = SETTING,
    rollout_rs: str | None = SETTING,
    rollout_rs_threshold: float | str | None = SETTING,
    clip_ratio: float = SETTING,
    clip_ratio_low: float | None = SETTING,
    clip_ratio_high: float | None = SETTING,
    clip_ratio_c: float = SETTING,
    loss_agg_mode: str = SETTING,
    denominator: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = SETTING,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's bypass mode (``rollout_correction.bypass_mode``): ``old_log_prob`` *is* the rollout engine's, so two
    policies instead of three. Rejection sampling (``rollout_rs``) drops tokens by the mismatch pi / pi_rollout;
    then ``loss_type`` ppo_clip: PPO's clipped loss with that ratio (the clip bounds the IS ratio; no weights
    on top), or reinforce: -w A log pi with w the rollout IS weights of pi / pi_rollout (truncated, detached; 1
    without ``rollout_is``). Weights and rejection are of this call's rows (batch normalisation too, as in verl,
    where the loss computes them per micro-batch); the given ``rollout_is_weights`` are not used."""
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"unknown bypass loss_type {loss_type!r}; valid: {list(BYPASS_LOSS_TYPES)}")
    current = log_prob.detach()
    mask = response_mask
    metrics: dict[str, torch.Tensor] = {}
    if rollout_rs is not None:
        if denominator is None:  # rejected tokens count as zeros of the call's normaliser, as in the actor (verl's)
            denominator = agg_denominator(response_mask, loss_agg_mode).clamp(min=1)
        mask, rs = rollout_rejection_mask(current, old_log_prob, response_mask, rollout_rs, rollout_rs_threshold)
        metrics["rollout_rs_masked_fraction"] = torch.tensor(rs["rollout_rs_masked_fraction"], dtype=log_prob.dtype)
    if loss_type == "ppo_clip":
        pg_loss, pg_metrics = compute_policy_loss(
            old_log_prob, log_prob, advantages, mask, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c,
            loss_agg_mode, denominator, loss_scale_factor,
        )  # fmt: skip
        return pg_loss, pg_metrics | metrics
    weights = None
    if rollout_is is not None:
        weights = is_weights(current, old_log_prob, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
    losses = weighted(-advantages * log_prob, weights)
    pg_loss = agg_loss(losses, mask, loss_agg_mode, denominator, loss_scale_factor)
    return pg_loss, {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask)} | metrics
