"""Advantage estimators: turn per-token rewards into per-token advantages.

Estimators live in a name -> function registry so the trainer config can pick one by string
(``algorithm.adv_estimator``) and a validator can list what exists. Every estimator is called the same way,
``(token_level_rewards, response_mask, index=..., **options)``, and takes from ``options`` (``gamma``,
``norm_adv_by_std_in_grpo``, ...) what it uses, ignoring the rest, so the trainer needs no per-estimator code.
"""

from collections.abc import Callable, Sequence

import numpy as np
import torch

AdvEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimator], AdvEstimator]:
    """Decorator adding an estimator under ``name``; a taken name is an error, not a silent override."""

    def decorator(fn: AdvEstimator) -> AdvEstimator:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"adv_estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvEstimator:
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {name!r}; valid: {sorted(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def _group_means(scores: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group of each row [B], rows per group [G], mean score per group [G]) of per-row ``scores``."""
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} ids but the batch has {scores.shape[0]} rows")
    group = _group_indices(index, scores.device)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    counts = torch.bincount(group, minlength=num_groups).to(scores.dtype)
    sums = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, group, scores)
    return group, counts, sums / counts


def _group_indices(index: Sequence | np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Map arbitrary hashable group ids (str/int) to 0..G-1, numbered by first appearance."""
    ids = index.tolist() if isinstance(index, np.ndarray | torch.Tensor) else list(index)
    first_seen = {gid: i for i, gid in enumerate(dict.fromkeys(ids))}
    return torch.tensor([first_seen[gid] for gid in ids], dtype=torch.long, device=device)


@register_adv_estimator("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: each response's total reward, normalised within its prompt's group.

    token_level_rewards, response_mask: [batch, response_len]; index: [batch] group ids, one per row,
    rows sharing an id are samples of the same prompt. A singleton group has no peers to compare with,
    so it uses mean 0 / std 1 (its advantage is its raw score). ``norm_adv_by_std_in_grpo=False`` is
    Dr.GRPO (no std division). Returns (advantages, returns), both [batch, response_len] and equal,
    zero where the mask is zero.
    """
    scores = token_level_rewards.sum(dim=-1)
    group, counts, mean = _group_means(scores, index)
    sq_dev = (scores - mean[group]) ** 2
    var = torch.zeros_like(mean).index_add_(0, group, sq_dev) / (counts - 1).clamp(min=1)  # unbiased
    singleton = counts == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(var), var.sqrt())

    score_adv = scores - mean[group]
    if norm_adv_by_std_in_grpo:
        score_adv = score_adv / (std[group] + epsilon)
    advantages = score_adv.unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


@register_adv_estimator("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): each response's score minus the mean score of the *other* responses of its
    group, a baseline that does not contain the response itself (so it stays unbiased). A group of one has no
    others: it keeps its score. Returns (advantages, returns), equal, [batch, response_len], zero off the mask.

    With n responses and group mean m, the others' mean is (n m - x) / (n - 1), so x minus it is n/(n-1) (x - m).
    """
    scores = token_level_rewards.sum(dim=-1)
    group, counts, mean = _group_means(scores, index)
    n = counts[group]
    score_adv = torch.where(n > 1, (scores - mean[group]) * n / (n - 1).clamp(min=1), scores)
    advantages = score_adv.unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor | None = None,
    gamma: float = 1.0,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): per-token discounted returns G_t = r_t + gamma G_{t+1} of the token-level rewards
    (KL-in-reward already subtracted by the caller), whitened over the valid tokens of the whole batch: the
    batch is the baseline, no groups (``index`` is unused). A return does not flow back across masked tokens.
    Whitening: (G - mean) / sqrt(unbiased var + 1e-8). Returns (advantages, returns), zero off the mask.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns * mask


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the entries where ``mask`` is 1, var unbiased (n - 1)."""
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    var = ((values - mean).square() * mask).sum() / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps)
