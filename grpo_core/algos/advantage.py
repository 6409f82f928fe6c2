"""Advantage estimators: turn per-token rewards into per-token advantages.

Estimators live in a name -> function registry so the trainer config can pick one by string
(``algorithm.adv_estimator``) and a validator can list what exists.
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: each response's total reward, normalised within its prompt's group.

    token_level_rewards, response_mask: [batch, response_len]; index: [batch] group ids, one per row,
    rows sharing an id are samples of the same prompt. A singleton group has no peers to compare with,
    so it uses mean 0 / std 1 (its advantage is its raw score). ``norm_adv_by_std_in_grpo=False`` is
    Dr.GRPO (no std division). Returns (advantages, returns), both [batch, response_len] and equal,
    zero where the mask is zero.
    """
    scores = token_level_rewards.sum(dim=-1)
    if len(index) != scores.shape[0]:
        raise ValueError(f"index has {len(index)} ids but the batch has {scores.shape[0]} rows")
    group = _group_indices(index, scores.device)
    num_groups = int(group.max()) + 1 if group.numel() else 0

    counts = torch.bincount(group, minlength=num_groups).to(scores.dtype)
    mean = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, group, scores)
    mean = mean / counts
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
