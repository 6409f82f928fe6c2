"""Reward shaping applied to each response's score before the advantage."""

import torch

from grpo_core.algos.settings import SETTING, schema_defaults


@schema_defaults
def overlong_penalty(
    response_lengths: torch.Tensor, max_resp_len: int, buffer_len: int, penalty_factor: float = SETTING
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to ``max_resp_len - buffer_len`` tokens, then
    falling linearly to ``-penalty_factor`` at ``max_resp_len``, so a run learns to stop before truncation
    instead of being scored as if a cut-off answer were a wrong one. One value per response, to add to its score."""
    expected = max_resp_len - buffer_len
    exceed = response_lengths.to(torch.float64) - expected
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)
