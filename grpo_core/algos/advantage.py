"""Advantage estimators: turn per-token rewards into per-token advantages.

Estimators live in a name -> function registry so the trainer config can pick one by string
(``algorithm.adv_estimator``) and a validator can list what exists. Every estimator is called the same way,
``(token_level_rewards, response_mask, index=..., **options)``, and takes from ``options`` (``gamma``,
``norm_adv_by_std_in_grpo``, ...) what it uses, ignoring the rest, so the trainer needs no per-estimator code.
Those settings default to the schema's (``SETTING``: see algos/settings.py).
"""

from collections.abc import Callable, Sequence

import numpy as np
import torch

from grpo_core.algos.settings import SETTING, schema_defaults

AdvEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimator], AdvEstimator]:
    """Decorator adding an estimator under ``name``, its ``SETTING`` keywords given the schema's defaults; a taken
    name is an error, not a silent override."""

    def decorator(fn: AdvEstimator) -> AdvEstimator:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"adv_estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = schema_defaults(fn)
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
    norm_adv_by_std_in_grpo: bool = SETTING,
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
    gamma: float = SETTING,
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


# ---- the rest of verl's critic-free estimators --------------------------------------------------------------------


@register_adv_estimator("grpo_vectorized")
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = SETTING,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's name for GRPO computed with group tensors instead of a loop; ``grpo`` here is already vectorised,
    and for groups of two or more both give the same advantages. A singleton group: its score (std of one sample
    taken as 1, mean 0), as ``grpo``."""
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
    )


@register_adv_estimator("rloo_vectorized")
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO as verl's vectorised version computes it: equal to ``rloo`` for groups of two or more; a singleton
    group, which has no other response to compare with, gets advantage 0 (``rloo`` keeps its score)."""
    scores = token_level_rewards.sum(dim=-1)
    group, counts, _ = _group_means(scores, index)
    advantages, _ = compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)
    advantages = torch.where((counts[group] > 1).unsqueeze(-1), advantages, torch.zeros_like(advantages))
    return advantages, advantages.clone()


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262): each response's score minus its group's mean (0 for a
    group of one), put on every token, then whitened over the valid tokens of the whole batch (the global
    normalisation of REINFORCE++). Returns (advantages, returns), equal, zero off the mask."""
    scores = token_level_rewards.sum(dim=-1)
    group, counts, mean = _group_means(scores, index)
    centred = scores - torch.where(counts > 1, mean, torch.zeros_like(mean))[group]
    mask = response_mask.to(scores.dtype)
    advantages = masked_whiten(centred.unsqueeze(-1) * mask, mask) * mask
    return advantages, advantages.clone()


@register_adv_estimator("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = SETTING,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (arXiv 2503.19595): only the best response of each group learns, with advantage
    (best score - second best), divided by the group's (unbiased) std + epsilon with norm_adv_by_std_in_grpo;
    every other response gets 0. Ties for best go to the first seen. Each group needs at least two responses."""
    scores = token_level_rewards.sum(dim=-1)
    group = _group_indices(index, scores.device)
    advantages = torch.zeros_like(scores)
    for g in range(int(group.max()) + 1 if group.numel() else 0):
        rows = torch.nonzero(group == g).squeeze(-1)
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per prompt; a group has {len(rows)}")
        top, at = torch.topk(scores[rows], 2)
        gap = top[0] - top[1]
        advantages[rows[at[0]]] = gap / (scores[rows].std() + epsilon) if norm_adv_by_std_in_grpo else gap
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


@register_adv_estimator("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (On-Policy RL with Optimal reward baseline, arXiv 2505.23585): the baseline is the length-weighted mean
    of the group's scores, b = sum(l_i r_i) / sum(l_i) with l_i a response's token count, which minimises the
    variance of the sequence-summed gradient; 0 for a group of one. Advantage: score - b, on every token."""
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    group, counts, _ = _group_means(scores, index)
    zeros = torch.zeros_like(counts)
    weighted = zeros.clone().index_add_(0, group, lengths * scores)
    total = zeros.clone().index_add_(0, group, lengths)
    baseline = torch.where(counts > 1, weighted / total.clamp(min=1), zeros)
    advantages = (scores - baseline[group]).unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


@register_adv_estimator("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    f_norm: float = 1.0,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv 2504.02546), as verl computes it: alpha (score - group mean) / f_norm, with no std division;
    alpha = batch size / number of responses with a non-zero score (at least 1), which scales the gradient up
    when few responses score, as the paper's B / (B - M) does for groups without signal. A group of one: mean 0."""
    scores = token_level_rewards.sum(dim=-1)
    group, counts, mean = _group_means(scores, index)
    alpha = scores.numel() / torch.count_nonzero(scores).clamp(min=1)
    centred = scores - torch.where(counts > 1, mean, torch.zeros_like(mean))[group]
    advantages = (alpha * centred / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


@register_adv_estimator("gdpo")
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = SETTING,
    reward_components: Sequence[torch.Tensor] | None = None,
    reward_weights: Sequence[float] | None = None,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242): each reward component normalised within its group on its own (GRPO per
    component), the results summed with ``reward_weights`` (default 1 each), then whitened over the batch's valid
    tokens, so a component with a large scale cannot drown the others. ``reward_components``: token-level
    rewards per component, each [batch, response_len]; without them the one reward is the only component
    (verl's fallback: GRPO then batch whitening)."""
    components = list(reward_components) if reward_components is not None else [token_level_rewards]
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(components)
    if len(weights) != len(components):
        raise ValueError(f"gdpo: {len(weights)} reward weights for {len(components)} reward components")
    total = torch.zeros_like(token_level_rewards)
    for weight, rewards in zip(weights, components, strict=True):
        normalised, _ = compute_grpo_outcome_advantage(
            rewards, response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
        )
        total = total + weight * normalised
    mask = response_mask.to(total.dtype)
    advantages = masked_whiten(total, mask) * mask
    return advantages, advantages.clone()


@register_adv_estimator("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    **_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505): REINFORCE whose baseline is the reward of the policy's greedy
    response to the same prompt, which costs one extra greedy generation per prompt instead of a critic. Each
    token's return-to-go (its reward plus every later token's: the response's score on every token when only the
    last token is rewarded) minus its row's baseline. ``reward_baselines`` [batch]: the greedy response's score
    for each row's prompt (the trainer draws it with the rollouts). ``index`` is unused. Returns (advantages,
    returns), zero off the mask."""
    if reward_baselines is None:
        raise ValueError("remax needs reward_baselines: the score of a greedy response to each row's prompt")
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"remax: {reward_baselines.shape[0]} reward baselines for {token_level_rewards.shape[0]} rows")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
    advantages = (returns - reward_baselines.to(returns.dtype).unsqueeze(-1)) * mask
    return advantages, returns * mask
