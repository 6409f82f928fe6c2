"""Training-inference mismatch correction: truncated importance sampling against the rollout engine.

The engine samples with its own kernels (and often another dtype), so its log-probs of the sampled tokens differ
from the actor's old log-probs. verl's ``algorithm.rollout_correction.rollout_is`` weights each token's policy loss
by w = min(pi_old / pi_rollout, threshold) (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"): the ratio corrects the sampling distribution, the truncation bounds its variance.
"""

import math

import torch

from grpo_core.config.defaults import schema_default

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-20 before exp(), so one wild token cannot make inf."""


def parse_is_threshold(threshold: float | int | str) -> tuple[float, float | None]:
    """(upper, lower or None) of verl's ``rollout_is_threshold``: a number (or a number as a string) is the upper
    bound of truncated IS; ``"lower_upper"`` (e.g. ``"0.5_5.0"``) is IcePop's window, outside which a weight is 0.
    Raises ValueError with one line on anything else or bounds that are not 0 < lower <= upper."""
    if isinstance(threshold, bool):
        raise ValueError(f"rollout_is_threshold={threshold}: a number or 'lower_upper', not a boolean")
    text = str(threshold).strip()
    lower_text, sep, upper_text = text.partition("_") if isinstance(threshold, str) else ("", "", text)
    try:
        upper = float(upper_text if sep else text)
        lower = float(lower_text) if sep else None
    except ValueError:
        raise ValueError(f"rollout_is_threshold={threshold!r}: a number or 'lower_upper' like '0.5_5.0'") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold={threshold!r} must be > 0 (or 'lower_upper' with 0 < lower <= upper)")
    return upper, lower


@torch.no_grad()
def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    threshold: float | str = schema_default("algorithm.rollout_correction.rollout_is_threshold"),
    batch_normalize: bool = False,
) -> torch.Tensor:
    """Detached weights [batch, response_len], zero off the mask. ``token``: each token's own ratio
    exp(old - rollout). ``sequence``: exp of the summed log-ratio over the response (clamped to +-20), the same
    weight for every token of that response. A number ``threshold`` truncates the weights at it (TIS); a
    ``"lower_upper"`` one zeroes those outside [lower, upper] (IcePop). ``batch_normalize`` divides them by their
    mean over this call's valid tokens (token) or non-empty rows (sequence), so they average 1 (verl's
    ``rollout_is_batch_normalize``: call it on the whole batch)."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; valid: {list(ROLLOUT_IS_LEVELS)}")
    upper, lower = parse_is_threshold(threshold)
    mask = response_mask.to(old_log_prob.dtype)
    log_ratio = (old_log_prob - rollout_log_prob) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    weights = raw.clamp(max=upper) if lower is None else raw * ((raw >= lower) & (raw <= upper))
    weights = weights * mask
    if batch_normalize:
        mean = batch_norm_factor(weights, mask, level)
        weights = torch.where(mean > 1e-8, weights / mean, weights)
    return weights


def batch_norm_factor(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """What ``rollout_is_batch_normalize`` divides the weights by: their mean over the valid tokens (token level)
    or over the non-empty rows' weights (sequence level, one weight a row)."""
    if level == "token":
        return weights.sum() / mask.sum().clamp(min=1)
    rows = mask.sum(dim=-1) > 0
    seq = weights.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return seq[rows].sum() / rows.sum().clamp(min=1)


@torch.no_grad()
def rollout_is_metrics(weights: torch.Tensor, response_mask: torch.Tensor, threshold: float | str) -> dict[str, float]:
    """``rollout_is/*`` over the valid tokens: mean and max weight, the effective sample size as a share of the
    tokens, (sum w)^2 / (n sum w^2) (1: uniform weights; small: a few tokens carry the update), and the share
    of tokens whose weight was truncated at ``threshold``."""
    w = weights[response_mask.bool()].double()
    threshold = parse_is_threshold(threshold)[0]
    if w.numel() == 0:
        return {}
    return {
        "rollout_is/mean": w.mean().item(),
        "rollout_is/max": w.max().item(),
        "rollout_is/eff_sample_size": (w.sum().square() / (w.numel() * w.square().sum()).clamp(min=1e-30)).item(),
        "rollout_is/clamped_share": (w >= threshold).double().mean().item(),
    }


# ---- rejection sampling (verl's rollout_rs) ------------------------------------------------------------------------

ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
"""verl's rejection criteria: a level (token, or a sequence's sum, mean or max of the token values) of one of
Schulman's three estimators of KL(pi_rollout || pi_old) per token, with l = log pi_old - log pi_rollout:
k1 = -l (bounded on both sides, as a ratio window), k2 = l^2 / 2 and k3 = e^l - 1 - l (upper bound only)."""


def parse_rs(rollout_rs: str, rollout_rs_threshold: float | int | str | None) -> dict[str, tuple[float | None, float]]:
    """{option: (lower, upper)} of verl's comma-separated ``rollout_rs`` and ``rollout_rs_threshold`` (one spec
    shared by every option, or one per option). k1 options take a ratio window ``"lower_upper"``, or one number
    as the upper ratio with its reciprocal as the lower; k2/k3 take one positive upper bound. One-line
    ValueErrors on anything else."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"rollout_rs={rollout_rs!r}: valid options (comma-separated): {list(ROLLOUT_RS_OPTIONS)}")
    if rollout_rs_threshold is None or isinstance(rollout_rs_threshold, bool):
        raise ValueError("rollout_rs needs rollout_rs_threshold (a number, or 'lower_upper' for the k1 options)")
    specs = [p.strip() for p in str(rollout_rs_threshold).split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold has {len(specs)} values for {len(options)} rollout_rs options")
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds = {}
    for option, spec in zip(options, specs, strict=True):
        try:
            if option.endswith("k1"):
                lower_text, sep, upper_text = spec.partition("_")
                upper = float(upper_text if sep else spec)
                lower = float(lower_text) if sep else 1.0 / upper
                if not 0 < lower <= upper:
                    raise ValueError
            else:
                lower, upper = None, float(spec)
                if "_" in spec or not upper > 0:
                    raise ValueError
        except (ValueError, ZeroDivisionError):
            raise ValueError(
                f"rollout_rs_threshold {spec!r} for {option}: "
                + (
                    "a ratio window 'lower_upper' (0 < lower <= upper) or one upper ratio"
                    if option.endswith("k1")
                    else "one upper bound > 0"
                )
            ) from None
        bounds[option] = (lower, upper)
    return bounds


@torch.no_grad()
def rollout_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str,
    rollout_rs_threshold: float | str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(the response mask with the rejected tokens zeroed, verl's ``rollout_rs_*`` metrics: each option's statistic's
    mean/max/min/std and the shares it masks, and the shares masked in all). A token is kept only if
    every option accepts it: a token option judges the token, a sequence option its whole response. With
    l = log pi_old - log pi_rollout (clamped to +-20): k1 keeps log(lower) <= -l <= log(upper) (summed or averaged
    over the response for seq_*_k1), k2 and k3 keep their value <= upper."""
    bounds = parse_rs(rollout_rs, rollout_rs_threshold)
    mask = response_mask.to(old_log_prob.dtype)
    valid = mask > 0
    log_ratio = (old_log_prob - rollout_log_prob).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -log_ratio, "k2": 0.5 * log_ratio.square(), "k3": log_ratio.exp() - 1.0 - log_ratio}
    lengths = mask.sum(dim=-1)
    rows = lengths > 0
    keep = torch.ones_like(mask, dtype=torch.bool)
    metrics: dict[str, float] = {}
    for option, (lower, upper) in bounds.items():
        level, estimator = option.rsplit("_", 1)
        value = per_token[estimator]
        if level == "seq_sum":
            value = (value * mask).sum(dim=-1, keepdim=True)
        elif level == "seq_mean":
            value = ((value * mask).sum(dim=-1) / lengths.clamp(min=1)).unsqueeze(-1)
        elif level == "seq_max":
            value = value.masked_fill(~valid, float("-inf")).max(dim=-1, keepdim=True).values
            value = torch.where(torch.isinf(value), torch.zeros_like(value), value)
        metrics |= _statistic_metrics(option, value[rows] if level != "token" else value[valid])
        value = value.expand_as(mask)
        ok = (value >= math.log(lower)) & (value <= math.log(upper)) if estimator == "k1" else value <= upper
        keep &= ok
        dropped = ~ok & valid
        metrics[f"rollout_rs_{option}_masked_fraction"] = _share(dropped.sum(), valid.sum())
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = _share((dropped.any(-1) & rows).sum(), rows.sum())
    dropped = ~keep & valid
    metrics["rollout_rs_masked_fraction"] = _share(dropped.sum(), valid.sum())
    metrics["rollout_rs_seq_masked_fraction"] = _share(dropped.any(-1).sum(), torch.tensor(mask.shape[0]))
    return (response_mask * keep).to(response_mask.dtype), metrics


def _statistic_metrics(option: str, values: torch.Tensor) -> dict[str, float]:
    """verl's ``rollout_rs_{option}_mean/max/min/std``: the statistic the option compares with its threshold, over
    the valid tokens (token options) or the non-empty responses (seq options); std of the population."""
    if values.numel() == 0:
        return {}
    v = values.double().flatten()
    return {
        f"rollout_rs_{option}_mean": v.mean().item(),
        f"rollout_rs_{option}_max": v.max().item(),
        f"rollout_rs_{option}_min": v.min().item(),
        f"rollout_rs_{option}_std": v.std(unbiased=False).item(),
    }


def _share(count: torch.Tensor, total: torch.Tensor) -> float:
    return float(count) / float(total) if float(total) > 0 else 0.0


@torch.no_grad()
def rollout_corr_metrics(
    weights: torch.Tensor | None,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float | str,
    level: str = "token",
    batch_normalize: bool = False,
) -> dict[str, float]:
    """verl's ``rollout_corr/*`` metrics of the importance weights (when on) and of the policies' mismatch:
    rollout_is_mean/max/min/std over valid tokens, rollout_is_eff_sample_size (1 / mean of (w / mean w)^2, the
    weights clamped at the upper threshold), rollout_is_ratio_fraction_high/low (raw token ratios beyond the
    bounds; lower: the given one or 1 / upper); rollout_is_seq_* of each response's raw ratio at ``level`` (token:
    the mean of its tokens' ratios; sequence: the ratio of the whole response); rollout_is_batch_norm_factor
    with ``batch_normalize``; and the mismatch's diagnostics (``offpolicy_metrics``)."""
    valid = response_mask.bool()
    if not valid.any():
        return {}
    upper, lower = parse_is_threshold(threshold)
    lower = 1.0 / upper if lower is None else lower
    log_ratio = (old_log_prob - rollout_log_prob)[valid].double()
    out = offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)
    if weights is None:
        return out
    mask = response_mask.double()
    rows = mask.sum(dim=-1) > 0
    token_ratios = ((old_log_prob - rollout_log_prob).double() * mask).clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    if level == "sequence":
        seq_log_ratio = ((old_log_prob - rollout_log_prob).double() * mask).sum(dim=-1)
        seq = seq_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()[rows]
    else:
        seq = ((token_ratios * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1))[rows]
    out |= {
        "rollout_corr/rollout_is_seq_mean": seq.mean().item(),
        "rollout_corr/rollout_is_seq_std": seq.std(unbiased=False).item(),
        "rollout_corr/rollout_is_seq_max": seq.max().item(),
        "rollout_corr/rollout_is_seq_min": seq.min().item(),
        "rollout_corr/rollout_is_seq_max_deviation": (seq - 1).abs().max().item(),
        "rollout_corr/rollout_is_seq_fraction_high": (seq > upper).double().mean().item(),
        "rollout_corr/rollout_is_seq_fraction_low": (seq < lower).double().mean().item(),
    }
    if batch_normalize:
        unnormalised = rollout_is_weights(old_log_prob, rollout_log_prob, response_mask, level, threshold)
        factor = batch_norm_factor(unnormalised, response_mask.to(unnormalised.dtype), level)
        out["rollout_corr/rollout_is_batch_norm_factor"] = factor.item()
    w = weights[valid].double()
    raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    clamped = w.clamp(min=0.0, max=upper)
    out |= {
        "rollout_corr/rollout_is_mean": w.mean().item(),
        "rollout_corr/rollout_is_max": w.max().item(),
        "rollout_corr/rollout_is_min": w.min().item(),
        "rollout_corr/rollout_is_std": (clamped.square().mean() - clamped.mean().square()).clamp(min=0).sqrt().item(),
        "rollout_corr/rollout_is_eff_sample_size": 1.0 / (clamped / (clamped.mean() + 1e-8)).square().mean().item(),
        "rollout_corr/rollout_is_ratio_fraction_high": (raw > upper).double().mean().item(),
        "rollout_corr/rollout_is_ratio_fraction_low": (raw < lower).double().mean().item(),
    }
    return out


@torch.no_grad()
def offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """verl's diagnostics of how far the engine's policy is from the old one, over valid tokens or non-empty rows:
    kl (k1 estimate of KL(pi_rollout || pi_old)), k3_kl; each response's log perplexity -mean(log p) under either
    policy (training_log_ppl, rollout_log_ppl, their exps training_ppl, rollout_ppl, means over responses);
    log_ppl_diff = mean log p_rollout - mean log p_old a response (training_log_ppl - rollout_log_ppl), its mean,
    mean absolute value, max and min; ppl_ratio = mean training_ppl / rollout_ppl a response; chi2_token and
    chi2_seq = E[rho^2] - 1 of the token ratios and of the responses' ratios (log-ratios clamped to +-20)."""
    valid = response_mask.bool()
    if not valid.any():
        return {}
    mask = response_mask.double()
    old, engine = old_log_prob.double() * mask, rollout_log_prob.double() * mask
    log_ratio = (old - engine)[valid]
    rows = mask.sum(dim=-1) > 0
    lengths = mask.sum(dim=-1)[rows]
    mean_old, mean_engine = old.sum(dim=-1)[rows] / lengths, engine.sum(dim=-1)[rows] / lengths
    diff = mean_engine - mean_old
    seq_log_ratio = (old - engine).sum(dim=-1)[rows].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "rollout_corr/kl": (-log_ratio).mean().item(),
        "rollout_corr/k3_kl": (log_ratio.exp() - log_ratio - 1).mean().item(),
        "rollout_corr/training_log_ppl": (-mean_old).mean().item(),
        "rollout_corr/training_ppl": (-mean_old).exp().mean().item(),
        "rollout_corr/rollout_log_ppl": (-mean_engine).mean().item(),
        "rollout_corr/rollout_ppl": (-mean_engine).exp().mean().item(),
        "rollout_corr/log_ppl_diff": diff.mean().item(),
        "rollout_corr/log_ppl_abs_diff": diff.abs().mean().item(),
        "rollout_corr/log_ppl_diff_max": diff.max().item(),
        "rollout_corr/log_ppl_diff_min": diff.min().item(),
        "rollout_corr/ppl_ratio": diff.exp().mean().item(),
        "rollout_corr/chi2_token": (2 * log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp().mean().item() - 1,
        "rollout_corr/chi2_seq": (2 * seq_log_ratio).exp().mean().item() - 1,
    }
