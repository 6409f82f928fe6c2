"""KL estimators between the policy and the reference policy, per token.

Names follow verl: k1 ("kl") is unbiased but high variance and can go negative, k2 ("mse") is the
squared log-ratio, k3 ("low_var_kl") is Schulman's non-negative low-variance estimator. A "+" suffix
keeps the named estimator's value but backpropagates k2's gradient (straight-through), because k2's
gradient is the unbiased gradient of KL(policy || ref) when used as a loss on on-policy samples.
"""

import torch


def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


def _abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    # Clamps keep exp() finite and bound a single token's penalty when the policies drift far apart.
    log_ratio = (ref_logprob - logprob).clamp(-20, 20)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)


_ESTIMATORS = {"kl": _k1, "k1": _k1, "abs": _abs, "mse": _k2, "k2": _k2, "low_var_kl": _k3, "k3": _k3}

KL_PENALTY_TYPES: tuple[str, ...] = (*_ESTIMATORS, *(f"{name}+" for name in _ESTIMATORS))


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Elementwise KL estimate; logprob and ref_logprob share any shape (typically [batch, response_len])."""
    if kl_penalty not in KL_PENALTY_TYPES:
        raise ValueError(f"unknown kl_penalty {kl_penalty!r}; valid: {list(KL_PENALTY_TYPES)}")
    base = _ESTIMATORS[kl_penalty.removesuffix("+")]
    value = base(logprob, ref_logprob)
    if not kl_penalty.endswith("+") or base is _k2:
        return value
    k2 = _k2(logprob, ref_logprob)
    return k2 - k2.detach() + value.detach()
