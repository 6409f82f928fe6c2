"""Sequence packing and token-budget micro-batches: no FLOP spent on padding.

A rollout row is a left-padded prompt followed by a right-padded response, so its real tokens are one
contiguous run. Packed, a micro-batch's runs are laid end to end in a single row, megatron's ``thd``
format: attention stays inside each sequence (``cu_seqlens``) and RoPE restarts at every sequence
start, so every token gets the logits it would get alone. ``logit_index`` maps the packed row back to
the [rows, response] grid the loss works on.

Token budgets (verl's ``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``) group consecutive rows into
micro-batches of at most that many tokens instead of a fixed number of rows.
"""

from dataclasses import dataclass, replace

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from grpo_core.data.batch import RolloutBatch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [1, T]: every row's real tokens, then padding up to T
    params: PackedSeqParams  # sequence boundaries (the tail padding is a sequence of its own)
    logit_index: torch.Tensor  # [rows, R]: the packed position whose logits predict each response token

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def map(self, fn) -> "PackedRows":
        """``fn`` applied to every tensor (the boundaries once: queries and keys share them)."""
        cu = fn(self.params.cu_seqlens_q)
        params = replace(self.params, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        return PackedRows(fn(self.input_ids), params, fn(self.logit_index))


def packed_length(batch: RolloutBatch, multiple: int = 1) -> int:
    total = int(batch.attention_mask.sum())
    return -(-total // multiple) * multiple


def pack(batch: RolloutBatch, multiple: int = 1, length: int | None = None) -> PackedRows:
    """The rows of ``batch`` as one packed row of ``length`` tokens (default: the real tokens, rounded up to
    ``multiple``, which sequence parallelism needs to split the row over TP ranks)."""
    mask = batch.attention_mask.bool()
    lengths = mask.sum(1)
    last = mask.long().argmax(1) + lengths - 1  # where each row's run ends, if it is one run
    if bool((lengths == 0).any() | (last >= mask.shape[1]).any()) or not bool(
        (mask.long().cumsum(1).gather(1, last[:, None]).squeeze(1) == lengths).all()
    ):
        raise ValueError("cannot pack: every row needs its tokens as one contiguous run (left-padded prompt, response)")
    ids = batch.input_ids[mask]  # row-major: each row's run in turn
    total = ids.numel()
    length = length or packed_length(batch, multiple)
    if length < total:
        raise ValueError(f"{total} tokens do not fit a packed row of {length}")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = lengths.cumsum(0)
    if length > total:
        ids = torch.nn.functional.pad(ids, (0, length - total))
        cu = torch.cat([cu, cu.new_tensor([length])])
    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    # response token j of row i sits at start_i + prompt_i + j and is predicted by the logits one before it;
    # padding positions past a row's end point at its last token (their values are masked out by the loss)
    prompt_lengths = mask[:, : mask.shape[1] - batch.response_length].sum(1)
    starts = cu[: len(lengths)].long()
    j = torch.arange(batch.response_length, device=ids.device)
    index = (starts + prompt_lengths - 1)[:, None] + j
    index = torch.minimum(index, (starts + lengths - 1)[:, None])
    return PackedRows(ids[None], params, index)


def split_by_tokens(batch: RolloutBatch, budget: int, packed: bool) -> list[RolloutBatch]:
    """Consecutive rows, as many per micro-batch as fit ``budget`` tokens: real tokens when packed, otherwise
    rows x the micro-batch's width (its padding counts). A row longer than the budget goes alone."""
    mask = batch.attention_mask.bool()
    lengths = mask.sum(1).tolist()
    widths = (mask.shape[1] - mask.long().argmax(1)).tolist()  # from the row's first token to the end

    def tokens(lo: int, hi: int) -> int:
        return sum(lengths[lo:hi]) if packed else (hi - lo) * max(widths[lo:hi])

    starts = [0]
    for i in range(1, batch.batch_size):
        if tokens(starts[-1], i + 1) > budget:
            starts.append(i)
    return [batch.rows(slice(lo, hi)) for lo, hi in zip(starts, [*starts[1:], batch.batch_size], strict=True)]
