"""Decode attention that reads each prompt's keys and values once for all of its samples.

A GRPO rollout decodes n samples of every prompt side by side; the static engine's cache holds the prompt's keys
n times (one copy per row) and a row-by-row attention kernel reads every copy at every step: at 512 rows, ~150-token
prompts and 256-token responses about half of what a decode step's attention reads. Here a step's attention is a
cascade (FlashInfer's name for it), in two Triton kernels over the engine's own cache, nothing copied:

1. prompt part, one program per (prompt, KV head, slice of slots): the queries of all n rows x the head's group
   (n * group rows of one matrix product) against the prompt's keys, read once from the prompt's first row; each
   slice leaves a partial softmax (its max, its sum of exponentials, its unnormalised output);
2. response part, one program per (row, KV head): the group's queries against the row's own response keys up to the
   slot written this step, then the prompt's partials merged in by their maxima, and the output written.

Bounds are read on the device (the step's slot, the chunk's prompt width and each row's first prompt slot), so one
CUDA graph serves every step of a chunk. On a CPU (tests: ``TRITON_INTERPRET=1``) the same kernels run in Triton's
interpreter.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch builds without Triton: the engine uses SDPA
    triton = None

SLICE = 128  # prompt slots per program of the prompt part (a partial softmax each)
BLOCK_N = 64  # slots per inner step


def grouped_matmul_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """One query per row [b, heads, 1, d] over its cache [b, kv_heads, L, d] as two batched matrix products: each KV
    head's group of query heads [group, d] against its keys, the softmax in fp32 with the additive ``bias``
    [b, 1, 1, L], times its values. The CPU's path: torch's CPU SDPA kernel, made for blocks of queries, spent about
    half of the demo's decode step at one query a row (SmolLM2-135M, 16 rows, ~250 slots; bench/cpu_step.py)."""
    b, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    scores = torch.matmul(q.view(b, kv_heads, heads // kv_heads, d), keys.transpose(-1, -2))  # [b, kv, group, L]
    weights = torch.softmax(scores.float() * d**-0.5 + bias, dim=-1).to(values.dtype)
    return torch.matmul(weights, values).view(b, heads, 1, d)


def summed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``grouped_matmul_attention`` as products and sums, for torch.compile on CPUs: there both become loops over
    the cache as it lies (its keys and values strided, in place), where a batched product copies its inputs into
    a dense batch first (the demo's step: 4.3 of its 25 ms). Eagerly it would write [b, kv_heads, group, L, d]."""
    b, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    grouped = q.view(b, kv_heads, heads // kv_heads, 1, d).float()
    scores = (grouped * keys[:, :, None].float()).sum(-1) * d**-0.5 + bias.view(b, 1, 1, -1)  # [b, kv, group, L]
    weights = torch.softmax(scores, dim=-1)
    attended = (weights[..., None] * values[:, :, None].float()).sum(-2)  # [b, kv, group, d]
    return attended.to(q.dtype).view(b, heads, 1, d)


def available(head_dim: int) -> bool:
    return triton is not None and head_dim in (16, 32, 64, 128, 256)


if triton is not None:

    @triton.jit
    def _attend(q, keys, values, c_slot, lo, hi, m_i, l_i, acc, scale_log2, D: tl.constexpr, BLOCK_N: tl.constexpr):
        """Online softmax of queries ``q`` [M, D] over slots lo..hi-1 of one head's keys and values, in base 2."""
        d = tl.arange(0, D)
        for first in range(lo, hi, BLOCK_N):
            n_idx = first + tl.arange(0, BLOCK_N)
            valid_n = n_idx < hi
            k = tl.load(keys + n_idx[:, None] * c_slot + d[None, :], mask=valid_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where(valid_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])  # m_new is finite: every block holds at least one valid slot
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(values + n_idx[:, None] * c_slot + d[None, :], mask=valid_n[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _prompt_partials(
        q_ptr,  # [rows, heads, d] (any strides)
        q_row,
        q_head,
        cache_ptr,  # [rows, 2 * kv_heads, slots, d]: keys' heads, then values'
        c_row,
        c_head,
        c_slot,
        start_ptr,  # [rows] int64: each row's first prompt slot (prompts are left-padded)
        width_ptr,  # [1] int64: the chunk's prompt width (the first response slot)
        m_ptr,  # [slices, rows, heads] fp32: each slice's max (log2 units)
        sum_ptr,  # [slices, rows, heads] fp32: its sum of exp2
        acc_ptr,  # [slices, rows, heads, d] fp32: its unnormalised output
        rows,
        heads,
        scale_log2,
        KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        N: tl.constexpr,  # rows per prompt
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SLICE: tl.constexpr,
        M_TILES: tl.constexpr,
    ):
        prompt = tl.program_id(0).to(tl.int64)  # int64: row offsets pass 2^31 elements
        g = tl.program_id(1)  # KV head
        piece = tl.program_id(2)
        part, tile = piece // M_TILES, piece % M_TILES
        m_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (row of the prompt, head of the group) pairs
        valid_m = m_idx < N * GROUP
        row = tl.where(valid_m, prompt * N + m_idx // GROUP, 0)
        head = tl.where(valid_m, g * GROUP + m_idx % GROUP, 0)
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + row[:, None] * q_row + head[:, None] * q_head + d[None, :], mask=valid_m[:, None], other=0.0
        )
        first_row = cache_ptr + prompt * N * c_row  # every row of the prompt holds the same prompt keys
        lo = tl.maximum(tl.load(start_ptr + prompt * N), part * SLICE)
        hi = tl.minimum(tl.load(width_ptr), (part + 1) * SLICE)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # a slice past the prompt stays empty: -inf, 0, 0
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        keys, values = first_row + g * c_head, first_row + (KV_HEADS + g) * c_head
        m_i, l_i, acc = _attend(q, keys, values, c_slot, lo, hi, m_i, l_i, acc, scale_log2, D, BLOCK_N)
        at = part * rows * heads + row * heads + head
        tl.store(m_ptr + at, m_i, mask=valid_m)
        tl.store(sum_ptr + at, l_i, mask=valid_m)
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=valid_m[:, None])

    @triton.jit
    def _response_and_merge(
        q_ptr,
        q_row,
        q_head,
        cache_ptr,
        c_row,
        c_head,
        c_slot,
        width_ptr,
        slot_ptr,  # [1] int64: the slot written this step (the last to attend to)
        m_ptr,
        sum_ptr,
        acc_ptr,
        out_ptr,  # [rows, heads, d], contiguous
        rows,
        heads,
        scale_log2,
        KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SLICES: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        m_idx = tl.arange(0, BLOCK_M)
        valid_m = m_idx < GROUP
        head = tl.where(valid_m, g * GROUP + m_idx, 0)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * q_row + head[:, None] * q_head + d[None, :], mask=valid_m[:, None], other=0.0)
        keys = cache_ptr + row * c_row + g * c_head
        values = cache_ptr + row * c_row + (KV_HEADS + g) * c_head
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        lo, hi = tl.load(width_ptr), tl.load(slot_ptr) + 1
        m_i, l_i, acc = _attend(q, keys, values, c_slot, lo, hi, m_i, l_i, acc, scale_log2, D, BLOCK_N)
        for part in tl.static_range(SLICES):  # m_i is finite from here on: the response holds this step's slot
            at = part * rows * heads + row * heads + head
            m_p = tl.load(m_ptr + at, mask=valid_m, other=float("-inf"))
            m_new = tl.maximum(m_i, m_p)
            alpha, beta = tl.exp2(m_i - m_new), tl.exp2(m_p - m_new)
            l_i = l_i * alpha + tl.load(sum_ptr + at, mask=valid_m, other=0.0) * beta
            acc_p = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=valid_m[:, None], other=0.0)
            acc = acc * alpha[:, None] + acc_p * beta[:, None]
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (row * heads + head[:, None]) * D + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=valid_m[:, None],
        )


def cascade_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    start: torch.Tensor,
    width: torch.Tensor,
    slot: torch.Tensor,
    rows_per_prompt: int,
    prompt_slots: int,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step's attention: q [rows, heads, d] (a row's query), ``cache`` [rows, 2 * kv_heads, slots, d] (the
    engine's, keys then values) -> [rows, heads, d]. A row attends to its prompt's slots from ``start[row]`` to
    ``width`` (excluded; the same in all ``rows_per_prompt`` rows of a prompt) and to its response slots from
    ``width`` to ``slot`` (included). ``prompt_slots`` bounds ``width`` (it sizes the prompt part's grid; slices past
    the prompt return at once). ``scale``: 1/sqrt(d) unless given."""
    rows, heads, d = q.shape
    kv_heads = cache.shape[1] // 2
    group = heads // kv_heads
    slices = -(-prompt_slots // SLICE)
    m = torch.empty(slices, rows, heads, device=q.device, dtype=torch.float32)
    sums = torch.empty_like(m)
    acc = torch.empty(slices, rows, heads, d, device=q.device, dtype=torch.float32)
    out = torch.empty(rows, heads, d, device=q.device, dtype=q.dtype)
    scale_log2 = (d**-0.5 if scale is None else scale) * 1.4426950408889634  # softmax in base 2
    common = dict(KV_HEADS=kv_heads, GROUP=group, D=d, BLOCK_N=BLOCK_N)
    prompt_rows = rows_per_prompt * group  # the prompt part's queries per program
    block_m = min(128, max(16, triton.next_power_of_2(prompt_rows)))
    tiles = -(-prompt_rows // block_m)
    _prompt_partials[(rows // rows_per_prompt, kv_heads, slices * tiles)](
        q, *q.stride()[:2], cache, *cache.stride()[:3], start, width, m, sums, acc, rows, heads, scale_log2,
        N=rows_per_prompt, BLOCK_M=block_m, SLICE=SLICE, M_TILES=tiles,
        num_warps=4 if block_m <= 64 else 8,  # a 128 x d fp32 accumulator spills from 4 warps' registers
        **common,
    )  # fmt: skip
    _response_and_merge[(rows, kv_heads)](
        q, *q.stride()[:2], cache, *cache.stride()[:3], width, slot, m, sums, acc, out, rows, heads, scale_log2,
        BLOCK_M=max(16, triton.next_power_of_2(group)), SLICES=slices, **common,
    )  # fmt: skip
    return out
