"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary. The max, the partition function
and the target's logit are combined across ranks with all-reduces, so no rank ever holds [.., vocab].
``reduce_from_tensor_model_parallel_region`` is megatron's all-reduce whose backward is the identity,
which is the right gradient for a sum whose result every rank then uses identically.
"""

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region


def _tp_max(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    return x


def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V/TP] (this rank's vocab slice), labels [...] -> (log p(label), entropy), both [...].

    ``vocab_size`` is the real vocabulary: columns beyond it (padding so the vocabulary splits evenly over
    TP) are excluded. The entropy is differentiable only when ``entropy_grad`` (an entropy bonus in the
    loss); otherwise it is a detached metric, which keeps one fewer vocab-sized tensor alive for backward.
    """
    logits = logits.float()
    vocab_local = logits.shape[-1]
    vocab_start = ps.get_tensor_model_parallel_rank() * vocab_local
    if vocab_size is not None and vocab_start + vocab_local > vocab_size:
        padded = torch.arange(vocab_start, vocab_start + vocab_local, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, float("-inf"))
    shifted = logits - _tp_max(logits.detach().amax(dim=-1)).unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_z = sum_exp.log()

    local = labels - vocab_start
    in_range = (local >= 0) & (local < vocab_local)
    picked = shifted.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tensor_model_parallel_region(picked * in_range)
    log_prob = picked - log_z

    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            plogit = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp))  # 0 * -inf at padded columns
            expected_logit = reduce_from_tensor_model_parallel_region(plogit.sum(dim=-1)) / sum_exp
            entropy = log_z - expected_logit
    return log_prob, entropy
