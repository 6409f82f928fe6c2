"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary. The max, the partition function,
the target's logit and the entropy's sum are combined across ranks with all-reduces, so no rank ever
holds [.., vocab]. The backward needs no communication: each rank's slice of the gradient depends only
on its own logits and the global sums.

The [tokens, vocab] tensors are the largest of the update (152k columns for Qwen). Nothing vocab-sized
in fp32 is ever stored: the forward reduces the bf16 logits to per-token sums (max, sum of exp, sum of
exp * logit) and saves only them and the logits; the backward recomputes the softmax from the logits
while writing the gradient. On GPUs each of those passes is one kernel (``torch.compile``), so the whole
log-prob costs about three reads of the bf16 logits and one write of their gradient.
"""

import torch
from megatron.core import parallel_state as ps

from grpo_core.models import fused


def _masked(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """fp32 logits, -inf at padding columns (those at or past ``vocab_size``)."""
    cols = torch.arange(logits.shape[-1], device=logits.device) + vocab_start
    return torch.where(cols < vocab_size, logits.float(), float("-inf"))


def _row_max(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    return _masked(logits, vocab_start, vocab_size).amax(-1)


def _exp_sums(logits: torch.Tensor, row_max: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """[2, ...]: sum_v exp(s_v) and sum_v exp(s_v) * s_v of the shifted logits s (0 * -inf counts as 0)."""
    s = _masked(logits, vocab_start, vocab_size) - row_max.unsqueeze(-1)
    e = s.exp()
    return torch.stack((e.sum(-1), torch.where(e > 0, e * s, 0.0).sum(-1)))


def _logits_grad(
    logits: torch.Tensor,
    labels_local: torch.Tensor,  # the label's column on this rank, -1 where another rank holds it
    row_max: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor,
    grad_log_prob: torch.Tensor,
    grad_entropy: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    entropy_grad: bool,
) -> torch.Tensor:
    """d/ds_v of g log p(y), i.e. g (1[v = y] - p_v), plus with ``entropy_grad`` that of g' H: -g' p_v (log p_v + H)."""
    log_p = _masked(logits, vocab_start, vocab_size) - (row_max + log_z).unsqueeze(-1)
    p = log_p.exp()
    cols = torch.arange(logits.shape[-1], device=logits.device)
    grad = torch.where(cols == labels_local.unsqueeze(-1), 1.0, 0.0) - p
    grad = grad * grad_log_prob.unsqueeze(-1)
    if entropy_grad:
        grad = grad - torch.where(p > 0, p * (log_p + entropy.unsqueeze(-1)), 0.0) * grad_entropy.unsqueeze(-1)
    return grad.to(logits.dtype)


_compiled = {f: torch.compile(f) for f in (_row_max, _exp_sums, _logits_grad)}


def _kernel(f, *args):
    """``f`` fused (compiled) on GPUs, the token count symbolic and the vocabulary fixed (see ``fused.token_dims``);
    eager on a CPU, where compiling would cost more than it saves."""
    if not args[0].is_cuda:
        return f(*args)
    return _compiled[f](*(fused.token_dims(a, 0) if isinstance(a, torch.Tensor) else a for a in args))


def _all_reduce(x: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, op=op, group=ps.get_tensor_model_parallel_group())
    return x


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_size, entropy_grad):
        shape = logits.shape
        logits, labels = logits.reshape(-1, shape[-1]), labels.reshape(-1)  # [tokens, V/TP]
        vocab_local = shape[-1]
        vocab_start = ps.get_tensor_model_parallel_rank() * vocab_local
        row_max = _all_reduce(_kernel(_row_max, logits, vocab_start, vocab_size), torch.distributed.ReduceOp.MAX)
        sum_exp, sum_es = _all_reduce(_kernel(_exp_sums, logits, row_max, vocab_start, vocab_size))

        local = labels - vocab_start
        in_range = (local >= 0) & (local < vocab_local)
        local = torch.where(in_range, local, -1)
        target = logits.gather(-1, local.clamp(min=0).unsqueeze(-1)).squeeze(-1).float() - row_max
        picked = _all_reduce(torch.where(in_range, target, 0.0))

        log_z = sum_exp.log()
        log_prob = picked - log_z
        entropy = log_z - sum_es / sum_exp
        ctx.save_for_backward(logits, local, row_max, log_z, entropy)
        ctx.vocab = (vocab_start, vocab_size)
        ctx.entropy_grad = entropy_grad
        ctx.shape = shape
        entropy = entropy.view(shape[:-1])
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_prob.view(shape[:-1]), entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, local, row_max, log_z, entropy = ctx.saved_tensors
        grad = _kernel(
            _logits_grad,
            logits,
            local,
            row_max,
            log_z,
            entropy,
            grad_log_prob.reshape(-1),
            grad_entropy.reshape(-1),
            *ctx.vocab,
            ctx.entropy_grad,
        )
        return grad.view(ctx.shape), None, None, None


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
    loss); otherwise it is a detached metric.
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * ps.get_tensor_model_parallel_world_size()
    entropy_grad = with_entropy and entropy_grad and torch.is_grad_enabled()
    log_prob, entropy = _VocabParallelLogProb.apply(logits, labels, vocab_size, entropy_grad)
    return log_prob, entropy if with_entropy else None
