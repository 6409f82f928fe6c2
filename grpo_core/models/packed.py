"""bf16 weights packed for oneDNN on CPUs with bf16 matrix instructions (AVX-512-BF16, AMX).

A plain bf16 ``F.linear`` on a CPU reorders its weight into oneDNN's blocked layout at every call. Packed once,
the reorder is skipped: the static engine packs its weights at every load (``pack``, ``packed_linear``), and
megatron's linears (``install``), while ``packed_weights()`` is open, pack each weight and its transpose at their
first use and reuse them for the input gradient and every later micro-batch. The scope is the actor's pass over
one mini-batch: weights change only between passes (the optimizer writes them through ``.data``, which no
version counter sees), so no pack outlives the weights it was made from.
"""

import functools
from contextlib import contextmanager

import torch
from torch.utils.weak import WeakIdKeyDictionary

_packs: WeakIdKeyDictionary | None = None  # weight -> (packed, packed transpose), inside ``packed_weights()``


@functools.cache  # asked at every linear's call inside ``packed_weights()``
def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold bf16 weights packed here (CPUs with bf16 matrix instructions)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [out, in] reordered once into oneDNN's blocked layout for GEMMs of about ``rows`` rows. A quiet
    16-row decode step ran 1.12-1.18x faster packed (bench/cpu_step.py); at the update's ~1,600 rows each
    product took 0.80-0.88 of its unpacked time. Same products, bit for bit."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("grpo::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over the weight as ``pack`` left it. An operator of its own, so a compiled
    function can call it (torch.compile cannot trace oneDNN's blocked weights); eager callers that are never
    compiled call ``_product`` itself (the operator's dispatch costs ~10 us a call)."""
    return _product(x, packed, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


TRAINING_ROWS = 2048  # the row count packs for megatron's linears are made for (a micro-batch's tokens)
LARGEST_PACKED = 16384
"""Output rows past which a weight (the lm-head's vocabulary) stays unpacked. SmolLM2's [49,152 x 576] lm-head at
768 rows: its product 64 ms unpacked against 63 packed, its input gradient 56 against 47, and packing the weight
and its transpose costs 19 + 75 ms, more than two micro-batches save. A layer's fc1 [3,072 x 576] at 1,568 rows:
6.1-6.8 ms unpacked against 5.5-5.8 packed each way, 0.3 + 1.3 ms to pack."""


@contextmanager
def packed_weights():
    """Within it, megatron's bf16 linears on CPUs run on packed weights, each packed at its first use."""
    global _packs
    outer, _packs = _packs, WeakIdKeyDictionary()
    try:
        yield
    finally:
        _packs = outer


def _packs_for(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if (
        _packs is None
        or weight.dtype != torch.bfloat16
        or len(weight) > LARGEST_PACKED
        or not can_pack(x.device, x.dtype)
    ):
        return None
    if weight not in _packs:
        w = weight.detach()
        _packs[weight] = (pack(w, TRAINING_ROWS), pack(w.t().contiguous(), TRAINING_ROWS))
    return _packs[weight]


class _PackedLinear(torch.autograd.Function):
    """x @ weight.T (+ bias): the output and the input's gradient from packed weights, the weight's gradient
    (activations by activations, nothing to pack) as megatron computes it."""

    @staticmethod
    def forward(ctx, x, weight, bias, packed, packed_t):
        ctx.save_for_backward(x)
        ctx.packed_t, ctx.has_bias = packed_t, bias is not None
        return _product(x, packed, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        grad_x = _product(grad, ctx.packed_t) if ctx.needs_input_grad[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_w = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def _on_packed_weights(megatron_linear):
    """megatron's linear function (trained or frozen weight), on packed weights where it needs no
    tensor-parallel communication (one rank's whole product) and ``packed_weights()`` is open. It takes megatron's
    function's attributes: megatron reads its ``warned`` flag through the module's name."""

    @functools.wraps(megatron_linear)
    def linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, *args, **kw):
        packs = None if allreduce_dgrad or sequence_parallel else _packs_for(input, weight)
        if packs is None or kw.get("grad_output_buffer") is not None:
            return megatron_linear(
                input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, *args, **kw
            )
        return _PackedLinear.apply(input, weight, bias, *packs)

    linear.on_packed_weights = True
    return linear


def install() -> None:
    """Route megatron's linears (``ColumnParallelLinear``, ``RowParallelLinear`` and its output layer call these
    two functions by name) through ``_on_packed_weights``."""
    from megatron.core.tensor_parallel import layers

    for name in ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight"):
        if not getattr(getattr(layers, name), "on_packed_weights", False):
            setattr(layers, name, _on_packed_weights(getattr(layers, name)))
