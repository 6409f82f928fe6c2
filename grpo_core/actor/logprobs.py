"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary. The max, the partition function,
the target's logit and the entropy's sum are combined across ranks with all-reduces, so no rank ever
holds [.., vocab]. The backward needs no communication: each rank's slice of the gradient depends only
on its own logits and the global sums.

The [tokens, vocab] tensors are the largest of the update (152k columns for Qwen). Nothing vocab-sized
in fp32 is ever stored: the forward reduces the bf16 logits to per-token sums (max, sum of exp, sum of
exp * logit) and saves only them and the logits; the backward recomputes the softmax from the logits
while writing the gradient. On GPUs each of those passes is one kernel (``torch.compile``), so the whole
log-prob costs about three reads of the bf16 logits and one write of their gradient. On a CPU the same
functions run eagerly, each in place in one fp32 copy of the logits (4x faster than out-of-place there).
"""

import torch
from megatron.core import parallel_state as ps

from grpo_core.models import fused

PAD_LOGIT = -1e30
"""Stands for -inf at padding columns: exp() of it is 0 and, unlike -inf, 0 times it is 0 (no NaN to mask)."""


def _real(logits: torch.Tensor, real_columns: int) -> torch.Tensor:
    """A fresh fp32 copy of the logits (callers work in it in place), ``PAD_LOGIT`` past the real vocabulary."""
    if real_columns == logits.shape[-1]:
        return logits.to(torch.float32, copy=True)
    cols = torch.arange(logits.shape[-1], device=logits.device)
    return torch.where(cols < real_columns, logits.float(), PAD_LOGIT)


def _row_max(logits: torch.Tensor, real_columns: int) -> torch.Tensor:
    if real_columns == logits.shape[-1]:
        return logits.amax(-1).float()  # exact in the logits' own dtype: no fp32 copy
    return _real(logits, real_columns).amax(-1)


def _exp_sums(logits: torch.Tensor, row_max: torch.Tensor, real_columns: int) -> torch.Tensor:
    """[2, ...]: sum_v exp(s_v) and sum_v exp(s_v) * s_v of the shifted logits s."""
    s = _real(logits, real_columns).sub_(row_max.unsqueeze(-1))
    e = s.exp()
    sum_exp = e.sum(-1)
    return torch.stack((sum_exp, e.mul_(s).sum(-1)))


def _logits_grad(
    logits: torch.Tensor,
    labels_local: torch.Tensor,  # the label's column on this rank, -1 where another rank holds it
    row_max: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor,
    grad_log_prob: torch.Tensor,
    grad_entropy: torch.Tensor,
    real_columns: int,
    entropy_grad: bool,
) -> torch.Tensor:
    """d/ds_v of g log p(y), i.e. g (1[v = y] - p_v), plus with ``entropy_grad`` that of g' H: -g' p_v (log p_v + H)."""
    log_p = _real(logits, real_columns).sub_((row_max + log_z).unsqueeze(-1))
    p = log_p.exp()
    cols = torch.arange(logits.shape[-1], device=logits.device)
    grad = torch.where(cols == labels_local.unsqueeze(-1), 1.0, 0.0).sub_(p).mul_(grad_log_prob.unsqueeze(-1))
    if entropy_grad:
        grad.sub_(p.mul_(log_p.add_(entropy.unsqueeze(-1))).mul_(grad_entropy.unsqueeze(-1)))
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
        real = max(0, min(vocab_local, vocab_size - vocab_start))  # this rank's columns that are not padding
        row_max = _all_reduce(_kernel(_row_max, logits, real), torch.distributed.ReduceOp.MAX)
        sum_exp, sum_es = _all_reduce(_kernel(_exp_sums, logits, row_max, real))

        local = labels - vocab_start
        in_range = (local >= 0) & (local < vocab_local)
        local = torch.where(in_range, local, -1)
        target = logits.gather(-1, local.clamp(min=0).unsqueeze(-1)).squeeze(-1).float() - row_max
        picked = _all_reduce(torch.where(in_range, target, 0.0))

        log_z = sum_exp.log()
        log_prob = picked - log_z
        entropy = log_z - sum_es / sum_exp
        ctx.save_for_backward(logits, local, row_max, log_z, entropy)
        ctx.real_columns = real
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
            ctx.real_columns,
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
