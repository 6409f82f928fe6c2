"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary. The max, the partition function,
the target's logit and the entropy's sum are combined across ranks with all-reduces, so no rank ever
holds [.., vocab]. The backward needs no communication: each rank's slice of the gradient depends only
on its own logits and the global sums.

The [tokens, vocab] tensors are the largest of the update (152k columns for Qwen). Nothing vocab-sized
in fp32 is ever stored: the forward reduces the bf16 logits to per-token sums (each rank's max, and relative to
it the sum of exp and of exp * logit, then moved to the max over ranks) and saves only them and the logits; the
backward recomputes the softmax from the logits while writing the gradient. On GPUs each is one Triton kernel:
the sums an online softmax over each row (one read of the logits), the gradient one program per row and block of
columns (a read and a write). Compiled by ``torch.compile`` they were two reads for the sums and, for the
gradient, a flat elementwise kernel that finds each element's row by dividing its index by the vocabulary size,
in 64-bit past 2^31 elements. On an H200 at 16,384 tokens (bench/logits_grad.py): sums 1.72 ms against 2.87
compiled, gradient 2.58 against 5.14 (the bytes alone 1.17 and 2.35). On a CPU the compiled forms' functions run
eagerly, each in place in one fp32 copy of the logits (4x faster than out-of-place there).
"""

import torch
from megatron.core import parallel_state as ps

from grpo_core.models import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # torch builds without Triton: the compiled gradient
    triton = None

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
    """[tokens, 2]: sum_v exp(s_v) and sum_v exp(s_v) * s_v of the shifted logits s."""
    s = _real(logits, real_columns).sub_(row_max.unsqueeze(-1))
    e = s.exp()
    sum_exp = e.sum(-1)
    return torch.stack((sum_exp, e.mul_(s).sum(-1)), dim=-1)


def _softmax_sums(logits: torch.Tensor, real_columns: int) -> torch.Tensor:
    """[3, tokens]: each row's max over this rank's real columns (``PAD_LOGIT`` if it has none) and, shifted by it,
    sum exp(s) and sum exp(s) * s. On GPUs one Triton kernel (one read of the logits), elsewhere two passes."""
    if logits.is_cuda and triton is not None:
        return _softmax_sums_triton(logits, real_columns)
    if real_columns == 0:  # a rank of TP padding only
        sums = logits.new_zeros(3, len(logits), dtype=torch.float32)
        sums[0] = PAD_LOGIT
        return sums
    row_max = _kernel(_row_max, logits, real_columns)
    return torch.cat((row_max[None], _kernel(_exp_sums, logits, row_max, real_columns).T))


def _shifted(sums: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """A rank's ``_softmax_sums`` moved from its own max m to ``top``: sum exp(x - top) = a sum exp(x - m) and
    sum exp(x - top) (x - top) = a (sum exp(x - m) (x - m) + (m - top) sum exp(x - m)), a = exp(m - top)."""
    row_max, sum_exp, sum_es = sums
    alpha = torch.exp(row_max - top)  # 0 for a rank of padding only, whose sums are 0
    return torch.stack((alpha * sum_exp, alpha * (sum_es + (row_max - top) * sum_exp)))


def _over_ranks(sums: torch.Tensor) -> torch.Tensor:
    """The ranks' ``_softmax_sums`` of their vocabulary slices -> the whole vocabulary's."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return sums
    top = _all_reduce(sums[0].clone(), torch.distributed.ReduceOp.MAX)
    return torch.cat((top[None], _all_reduce(_shifted(sums, top))))


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

if triton is not None:

    @triton.jit
    def _logits_grad_kernel(
        logits_ptr,  # [tokens, columns], rows ``row_stride`` apart
        grad_ptr,  # [tokens, columns], contiguous
        labels_ptr,  # [tokens] int64: the label's column here, -1 elsewhere
        shift_ptr,  # [tokens] fp32: row max + log Z, so that log p = logit - shift
        entropy_ptr,
        grad_log_prob_ptr,
        grad_entropy_ptr,
        row_stride,
        columns,
        real_columns,
        ENTROPY_GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < columns
        log_p = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=0.0).to(tl.float32)
        log_p -= tl.load(shift_ptr + row)
        p = tl.where(cols < real_columns, tl.exp(log_p), 0.0)  # padding columns: no probability, no gradient
        grad = (tl.where(cols == tl.load(labels_ptr + row), 1.0, 0.0) - p) * tl.load(grad_log_prob_ptr + row)
        if ENTROPY_GRAD:
            grad -= p * (log_p + tl.load(entropy_ptr + row)) * tl.load(grad_entropy_ptr + row)
        tl.store(grad_ptr + row * columns + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)


if triton is not None:

    @triton.jit
    def _softmax_sums_kernel(logits_ptr, out_ptr, row_stride, tokens, real_columns, BLOCK: tl.constexpr):
        """One row's max and, relative to it, sum exp(s) and sum exp(s) * s, in one read (an online softmax: the
        running sums rescaled whenever a block raises the max; one accumulator per lane, summed at the end)."""
        row = tl.program_id(0).to(tl.int64)
        # PAD_LOGIT (a kernel reads no Python globals): finite, so rescaling an empty accumulator gives 0, not NaN
        top = tl.max(tl.full([BLOCK], -1e30, tl.float32), 0)
        sum_exp = tl.zeros([BLOCK], tl.float32)
        sum_es = tl.zeros([BLOCK], tl.float32)
        for first in range(0, real_columns, BLOCK):
            cols = first + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < real_columns, other=-1e30)
            x = x.to(tl.float32)
            new_top = tl.maximum(top, tl.max(x, 0))
            alpha = tl.exp(top - new_top)
            e = tl.exp(x - new_top)
            sum_es = alpha * (sum_es + (top - new_top) * sum_exp) + e * (x - new_top)
            sum_exp = alpha * sum_exp + e
            top = new_top
        tl.store(out_ptr + row, top)
        tl.store(out_ptr + tokens + row, tl.sum(sum_exp, 0))
        tl.store(out_ptr + 2 * tokens + row, tl.sum(sum_es, 0))


def _softmax_sums_triton(logits: torch.Tensor, real_columns: int) -> torch.Tensor:
    """``_softmax_sums`` as one Triton kernel."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = logits.shape[0]
    out = torch.empty(3, tokens, device=logits.device, dtype=torch.float32)
    _softmax_sums_kernel[(tokens,)](logits, out, logits.stride(0), tokens, real_columns, BLOCK=4096, num_warps=8)
    return out


def _logits_grad_triton(logits, labels_local, row_max, log_z, entropy, grad_log_prob, grad_entropy, real_columns,
                        entropy_grad) -> torch.Tensor:  # fmt: skip
    """``_logits_grad`` as one Triton kernel (the same arguments, the same result)."""
    tokens, columns = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    grad = torch.empty(tokens, columns, device=logits.device, dtype=logits.dtype)
    block = min(4096, triton.next_power_of_2(columns))
    f32 = [t.float().contiguous() for t in (row_max + log_z, entropy, grad_log_prob, grad_entropy)]
    _logits_grad_kernel[(tokens, triton.cdiv(columns, block))](
        logits, grad, labels_local.contiguous(), *f32, logits.stride(0), columns, real_columns,
        ENTROPY_GRAD=entropy_grad, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return grad


CPU_ROWS = 64
"""Rows of logits a CPU pass works on at once: 64 x 49k fp32 columns (12 MB) stay in cache across the pass's
several elementwise steps. On 2 EPYC cores, [3,136 x 49,152] forward and backward: 1.12 s whole, 0.31 s by 64 rows,
0.34 by 16 and 0.49 by 256."""


def _kernel(f, *args):
    """``f`` fused (compiled) where ``fused.compiles`` says, the token count symbolic and the vocabulary fixed (see
    ``fused.token_dims``); elsewhere (an fp32 CPU) eager over ``CPU_ROWS`` rows at a time (each argument is
    [tokens, ...] or a plain value, and so is the result)."""
    if fused.compiles(args[0]):
        return _compiled[f](*(fused.token_dims(a, 0) if isinstance(a, torch.Tensor) else a for a in args))
    tokens = len(args[0])
    if tokens <= CPU_ROWS:
        return f(*args)
    parts = [
        f(*(a[i : i + CPU_ROWS] if isinstance(a, torch.Tensor) else a for a in args))
        for i in range(0, tokens, CPU_ROWS)
    ]
    return torch.cat(parts)


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
        row_max, sum_exp, sum_es = _over_ranks(_softmax_sums(logits, real))

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
        args = (logits, local, row_max, log_z, entropy, grad_log_prob.reshape(-1), grad_entropy.reshape(-1))
        if logits.is_cuda and triton is not None:
            grad = _logits_grad_triton(*args, ctx.real_columns, ctx.entropy_grad)
        else:
            grad = _kernel(_logits_grad, *args, ctx.real_columns, ctx.entropy_grad)
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
