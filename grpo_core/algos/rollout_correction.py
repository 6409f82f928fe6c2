"""Training-inference mismatch correction: truncated importance sampling against the rollout engine.

The engine samples with its own kernels (and often another dtype), so its log-probs of the sampled tokens differ
from the actor's old log-probs. verl's ``algorithm.rollout_correction.rollout_is`` weights each token's policy loss
by w = min(pi_old / pi_rollout, threshold) (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"): the ratio corrects the sampling distribution, the truncation bounds its variance.
"""

import torch

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-20 before exp(), so one wild token cannot make inf."""


@torch.no_grad()
def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    threshold: float = 2.0,
) -> torch.Tensor:
    """Detached weights [batch, response_len], zero off the mask. ``token``: each token's own ratio
    exp(old - rollout), truncated at ``threshold``. ``sequence``: exp of the summed log-ratio over the response
    (clamped to +-20), truncated, the same weight for every token of that response."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; valid: {list(ROLLOUT_IS_LEVELS)}")
    mask = response_mask.to(old_log_prob.dtype)
    log_ratio = (old_log_prob - rollout_log_prob) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    weights = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().clamp(max=threshold)
    return weights * mask


@torch.no_grad()
def rollout_is_metrics(weights: torch.Tensor, response_mask: torch.Tensor, threshold: float) -> dict[str, float]:
    """``rollout_is/*`` over the valid tokens: mean and max weight, the effective sample size as a share of the
    tokens, (sum w)^2 / (n sum w^2) (1: uniform weights; small: a few tokens carry the update), and the share
    of tokens whose weight was truncated at ``threshold``."""
    w = weights[response_mask.bool()].double()
    if w.numel() == 0:
        return {}
    return {
        "rollout_is/mean": w.mean().item(),
        "rollout_is/max": w.max().item(),
        "rollout_is/eff_sample_size": (w.sum().square() / (w.numel() * w.square().sum()).clamp(min=1e-30)).item(),
        "rollout_is/clamped_share": (w >= threshold).double().mean().item(),
    }
