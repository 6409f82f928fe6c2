"""Context parallelism without Transformer Engine: each CP rank holds two chunks of every sequence and attends
to the whole sequence's keys and values, all-gathered (the all-gather form of context parallelism; TE's ring
attention passes the chunks around instead, and is not used here: one path, the same on CPU and GPU).

The sequence is cut into 2 x CP chunks and rank r holds chunks r and 2CP-1-r, megatron's load-balanced order
(causal attention costs the same on every rank). The actor cuts the tokens, the rotary angles are cut here,
the attention gathers keys and values, and the actor gathers the per-token log-probs back to whole rows, where
every loss (sequence-level ones included) is computed as without CP.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def cp_size() -> int:
    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def local_positions(seq_len: int, device: torch.device | str = "cpu", rank: int | None = None) -> torch.Tensor:
    """The positions of the whole sequence that CP rank ``rank`` (default: this one) holds, in its order."""
    size = cp_size()
    rank = ps.get_context_parallel_rank() if rank is None else rank
    if seq_len % (2 * size):
        raise ValueError(f"a sequence of {seq_len} does not cut into 2 x CP = {2 * size} chunks")
    chunk = seq_len // (2 * size)
    starts = (rank * chunk, (2 * size - 1 - rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def local(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This CP rank's part of a whole-sequence tensor (sequence along ``dim``)."""
    return x.index_select(dim, local_positions(x.shape[dim], x.device))


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` into whole-sequence order. Backward: this rank's part of the gradient, summed over
    the CP ranks first when each rank's gradient differs (keys and values: each rank's queries read them all);
    not when every rank computes the same thing from the whole (the loss from the gathered log-probs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, sum_grads: bool) -> torch.Tensor:
        ctx.dim, ctx.sum_grads = dim, sum_grads
        size, group = cp_size(), ps.get_context_parallel_group()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        whole_len = x.shape[dim] * size
        where = torch.cat([local_positions(whole_len, x.device, r) for r in range(size)])
        return torch.cat(parts, dim).index_select(dim, torch.argsort(where))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sum_grads:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ps.get_context_parallel_group())
        return local(grad, ctx.dim), None, None


def gather(x: torch.Tensor, dim: int, sum_grads: bool) -> torch.Tensor:
    """The whole sequence from every CP rank's part (see ``_Gather`` for ``sum_grads``)."""
    return _Gather.apply(x, dim, sum_grads)


def causal_mask(local_len: int, device: torch.device) -> torch.Tensor:
    """[local_len, whole_len] bool, True = masked: this rank's queries against the whole sequence's keys."""
    whole = local_len * cp_size()
    queries = local_positions(whole, device)
    return torch.arange(whole, device=device)[None, :] > queries[:, None]


def cut_rotary(rotary: torch.nn.Module) -> None:
    """megatron's RotaryEmbedding cuts its angles for this CP rank through pinned memory and ``.cuda()``, which a
    CPU run lacks: it returns the whole sequence's angles here, cut by ``local`` on their own device."""
    rotary.cp_group = None
    whole = rotary.forward

    def forward(*args, **kwargs):
        kwargs.pop("cp_group", None)
        angles = whole(*args, **kwargs)  # [s, 1, 1, dim] for the whole sequence (its length counts every CP rank)
        return angles if kwargs.get("packed_seq") else local(angles, 0)

    rotary.forward = forward
