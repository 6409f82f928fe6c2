"""The typed batch that moves between the GRPO stages (rollout -> reward -> advantage -> actor).

Rows are ``prompt (left-padded to P) + response (right-padded to R)``, as in verl: every response
starts at column P, so response tensors are the last R columns and need no per-row offsets.
"""

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, P+R] token ids; padding is any id, masked by attention_mask
    attention_mask: torch.Tensor  # [B, P+R] 1 for real tokens
    response_mask: torch.Tensor  # [B, R] 1 for response tokens that count in the loss
    old_log_probs: torch.Tensor | None = None  # [B, R] behaviour policy (the actor before this step's update)
    ref_log_probs: torch.Tensor | None = None  # [B, R] frozen reference policy, for the KL term
    advantages: torch.Tensor | None = None  # [B, R]
    rollout_log_probs: torch.Tensor | None = None  # [B, R] the engine's log-probs of the sampled tokens (0: padding)
    # [B, R] rollout importance weights of the whole batch, when the trainer computes them (batch-normalised)
    rollout_is_weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions count real tokens only, so left padding does not shift RoPE."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_length :]

    def map(self, fn) -> "RolloutBatch":
        """``fn`` applied to every tensor present."""
        present = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return replace(self, **{name: fn(value) for name, value in present.items()})

    def rows(self, index: torch.Tensor | slice) -> "RolloutBatch":
        return self.map(lambda t: t[index])

    def split(self, size: int) -> list["RolloutBatch"]:
        """Consecutive chunks of ``size`` rows (the last may be shorter)."""
        return [self.rows(slice(i, i + size)) for i in range(0, self.batch_size, size)]

    def without_leading_padding(self) -> "RolloutBatch":
        """The same rows without the prompt columns that are padding in every row, so a micro-batch of short
        prompts does not pay for the whole batch's longest; responses keep their columns, positions their values."""
        lead = int(self.attention_mask.any(0).long().argmax())  # the first column some row uses
        if lead == 0:
            return self
        return replace(self, input_ids=self.input_ids[:, lead:], attention_mask=self.attention_mask[:, lead:])

    def to(self, device: torch.device | str) -> "RolloutBatch":
        return self.map(lambda t: t.to(device))
