"""Fused kernels for megatron-core without Transformer Engine or Apex, built from torch.

megatron takes its fused kernels from TE or Apex and refuses the flags that ask for them when neither is
installed; on a plain PyPI install every element-wise chain of a layer is then five to seven passes
over its activations, and every weight gradient an extra pass over fp32 memory. ``fusion_flags()`` turns
on what torch can provide instead, on GPUs and, in bf16 where a C++ compiler is found, on CPUs (``compiles``);
an fp32 CPU process stays eager: its element-wise passes are a small part of its slow products.

- RMSNorm: one ``torch.compile``d kernel each way (used by ``spec.RMSNorm``);
- RoPE: a compiled rotate-half, given to megatron through its ``apply_rope_fusion`` hooks
  (``rope_utils.fused_apply_rotary_pos_emb`` and its packed-sequence ``_thd`` twin, which TE would fill), the
  angles' cos and sin computed once per micro-batch (``_CosSin``); with it on, ``spec.SplitRopeSelfAttention``
  splits megatron's QKV projection and rotates the queries and keys in one kernel (``split_rope``);
- linear biases: added by a compiled kernel, not torch's broadcasting add (``install_bias_add``);
- attention over packed sequences: torch's variable-length flash kernel (``varlen_causal_attention``); on CPUs,
  for short rows, batched products (``causal_attention_by_products``);
- SwiGLU: megatron's own ``bias_activation_fusion`` (its ``jit_fuser`` is ``torch.compile``), its backward
  replaced on GPUs by one that reads its inputs once (``_swiglu_back``);
- weight-gradient accumulation: ``gradient_accumulation_fusion`` writes each weight gradient straight
  into its fp32 ``main_grad`` from the GEMM (cuBLAS with bf16 inputs and an fp32 accumulator, through
  ``torch.addmm(..., out_dtype=float32)``) instead of a bf16 gradient plus an fp32 add, which for a 7B
  model is ~75 GB of memory traffic per micro-batch. megatron reads the kernel from Apex's
  ``fused_weight_gradient_mlp_cuda``; we register a module of that name.

The optimizer step gets the same treatment (``install_optimizer_kernels``, ``use_fused_adam``): foreach
kernels for the grad norm and clipping, torch's fused AdamW.
"""

import inspect
import shutil
import sys
import types
import weakref

import torch

from grpo_core.models import packed

FUSIONS_NEEDING_KERNELS = {"bias_dropout_fusion": ("transformer_engine", "apex")}
"""Kernel-fusion flags that megatron refuses at start-up without one of these packages (RoPE, SwiGLU and
gradient-accumulation fusion are on by default on GPUs, served by torch: this module)."""

_compile_on_cpu = False  # set by ``fusion_flags`` in a bf16 CPU process (``compiles``)


def can_compile_on_cpu() -> bool:
    """Whether torch.compile can build CPU kernels here: its C++ compiler is installed."""
    from torch._inductor import config

    return shutil.which(config.cpp.cxx[-1] or "g++") is not None


def compiles(t: torch.Tensor) -> bool:
    """Whether the element-wise chains over ``t`` run compiled: on GPUs, and on CPUs in bf16 once ``fusion_flags``
    built a bf16 model here with a C++ compiler. On 2 EPYC cores the demo's update (16 rows, ~3,100 tokens) took
    3.90-4.10 s compiled, with its weights packed (models/packed.py), against 4.37-4.67 s eager and unpacked
    (bench/cpu_step.py, five runs); compiling costs a process's first update ~6 s (~1.2 s with torch's cache of
    earlier runs warm)."""
    return t.is_cuda or (_compile_on_cpu and t.dtype == torch.bfloat16)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama/Qwen RMSNorm: normalise in fp32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_norm_back(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """``_rms_norm``'s gradient for rows x [tokens, hidden] as autograd takes it through its steps (the cast back,
    the scale in the weight's dtype), and the weight's per-token terms ``g * normed`` [tokens, hidden]: their sum
    over tokens is left to torch's reduction kernel (``_CompiledRMSNorm.backward``), as eager autograd does it,
    so the compiled kernel reduces only over the fixed hidden size."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = h * rstd
    g_normed = (g * weight).float()
    g_x = rstd * (g_normed - normed * (g_normed * normed).mean(-1, keepdim=True))
    return g_x.to(x.dtype), g * normed.to(x.dtype)


# Each called on plain (not view) [tokens, hidden] rows with only the token count symbolic (``_rows``).
_rms_norm_compiled = torch.compile(_rms_norm)
_rms_norm_back_compiled = torch.compile(_rms_norm_back)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous [tokens, hidden] rows that are no view (dynamo guards on a view's base too: [b, 1, h]
    decode rows against [s, b, h] ones), the token count symbolic."""
    rows = t.reshape(-1, t.shape[-1])
    return token_dims((rows if rows.is_contiguous() else rows.contiguous()).detach(), 0)


class _CompiledRMSNorm(torch.autograd.Function):
    """Forward and backward as two compiled functions of their own, on plain rows: under autograd one compiled
    function guards on the grad mode and every input's ``requires_grad`` too, so the actor's training, its
    log-prob passes and the engine each took graphs of their own."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = _rows(x)
        ctx.eps = eps
        ctx.save_for_backward(rows, weight)
        return _rms_norm_compiled(rows, weight.detach(), eps).view(x.shape)

    @staticmethod
    def backward(ctx, g):
        rows, weight = ctx.saved_tensors
        g_x, g_weight_terms = _rms_norm_back_compiled(_rows(g), rows, weight.detach(), ctx.eps)
        g_weight = g_weight_terms.sum(0) if ctx.needs_input_grad[1] else None
        return g_x.view(g.shape), g_weight, None


def compiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``_rms_norm`` compiled, over ``x``'s rows. Called on its own layouts (megatron's [s, b, h], packed [t, 1, h],
    the engine's [b, s, h], a last-token slice, a transposed q/k) under autograd, each layout, stride pattern,
    grad mode and ``requires_grad`` was a guard of its own: a 16-row ``grpo train`` run took all 8 graphs
    torch.compile keeps per function and ran the rest eagerly. Now the forward keeps one graph (and one for a
    single token, one per other hidden size), the backward one (tests/test_fused_compile.py counts them)."""
    if torch.compiler.is_compiling():  # inside another compiled function (the engine's blocks): part of its graph
        return _rms_norm(x, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _CompiledRMSNorm.apply(x, weight, eps)
    return _rms_norm_compiled(_rows(x), weight.detach(), eps).view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return compiled_rms_norm(x, weight, eps) if compiles(x) else _rms_norm(x, weight, eps)


def _rotate_half(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with the angles' cos and sin given (in t's dtype, as HF casts them)."""
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's unfused ``_apply_rotary_pos_emb_bshd`` (rotate-half) by the angles ``freqs`` [s, 1, 1, d]; with
    fewer angles than the head size (partial rotation) the rest of each head passes unchanged."""
    if interleaved:
        raise NotImplementedError("the fused RoPE here is for rotate-half (Llama/Qwen) layouts only")
    rot = freqs.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    out = _rotate_half(t, torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype))
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def token_dims(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """Mark ``dims`` of ``t`` (token counts: they change with every micro-batch) symbolic for ``torch.compile``
    and specialise the rest (heads, head size, vocabulary). With every size symbolic, each element's index costs
    integer divisions by run-time values: on an H200 that made the compiled RoPE and log-prob gradient run at a
    fifth to a quarter of the memory bandwidth."""
    for d in range(t.dim()):
        if d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
        else:
            torch._dynamo.mark_static(t, d)
    return t


_rope_compiled = torch.compile(_rope)  # called with token_dims marked (megatron's hooks below)


def _rope_heads(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    """The engine's RoPE: t [b, heads, s, d], its first ``rotated`` heads turned by ``cos`` and ``sin`` [b, 1, s, d],
    the other heads copied as they are."""
    head = torch.arange(t.shape[1], device=t.device)[:, None, None]
    return torch.where(head < rotated, _rotate_half(t, cos, sin), t)


_rotate_half_compiled = torch.compile(_rotate_half)  # megatron's hooks below; tokens symbolic (token_dims)
_rope_heads_compiled = torch.compile(_rope_heads)


def compiled_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    """``_rope_heads`` compiled, rows and positions symbolic: prefill and decode take a graph each."""
    return _rope_heads_compiled(token_dims(t, 0, 2), token_dims(cos, 0, 2), token_dims(sin, 0, 2), rotated)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int | None = None) -> torch.Tensor:
    """``_rope_heads`` over the engine's ``t`` [b, heads, s, d] (all heads rotated unless ``rotated`` says how many),
    one kernel on GPUs. The caller computes cos and sin once per forward: on an H200 a 512-row decode step spent
    0.27 of its 5.5 ms in a kernel that computed them for every layer and head, 0.06 ms since."""
    rotated = t.shape[1] if rotated is None else rotated
    if torch.compiler.is_compiling():  # inside another compiled function (the engine's CPU decode layer)
        return _rope_heads(t, cos, sin, rotated)
    return (compiled_rope if compiles(t) else _rope_heads)(t, cos, sin, rotated)


def _positions(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each packed token's position in its sequence: they restart at every ``cu_seqlens`` boundary."""
    cu = cu_seqlens.long()
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=tokens)
    return torch.arange(tokens, device=cu.device) - starts


class _CosSin:
    """cos and sin of the RoPE angles megatron last passed, kept while the same tensors come back: one ``freqs``
    (and, packed, one ``cu_seqlens``) serves every layer's queries and keys of a forward, so the angles' cos and sin
    and the packed positions' gather are computed once per micro-batch instead of twice per layer. Keyed on the
    tensors' identity (weak references: a freed tensor whose address is reused is not the same key)."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, dtype: torch.dtype, freqs: torch.Tensor, cu_seqlens: torch.Tensor | None = None, tokens: int = 0):
        refs = (freqs, cu_seqlens)
        if (
            self._value is None
            or self._value[0].dtype != dtype
            or any((r() if r is not None else None) is not t for r, t in zip(self._key, refs, strict=True))
        ):
            if cu_seqlens is not None:  # packed: the angles of each token's position in its sequence
                freqs = freqs[_positions(cu_seqlens, tokens)]
            self._key = tuple(weakref.ref(t) if t is not None else None for t in refs)
            self._value = (freqs.cos().to(dtype), freqs.sin().to(dtype))
        return self._value


_cos_sin = _CosSin()


def _rotated(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``_rotate_half`` of megatron's [tokens, b, heads, d], compiled (``compiles``) with the token count symbolic."""
    if not compiles(t):
        return _rotate_half(t, cos, sin)
    return _rotate_half_compiled(token_dims(t, 0, 1), token_dims(cos, 0), token_dims(sin, 0))


def _rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's ``fused_apply_rotary_pos_emb`` hook: t [s, b, heads, d], freqs [s, 1, 1, d]."""
    if not (interleaved or freqs.shape[-1] != t.shape[-1]):
        return _rotated(t, *_cos_sin.get(t.dtype, freqs))
    if not compiles(t):  # interleaved (refused) or a partial rotation: the general form
        return _rope(t, freqs, interleaved)
    return _rope_compiled(token_dims(t, 0, 1), token_dims(freqs, 0), interleaved)


def _rope_thd(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1, cp_rank: int = 0, **kwargs
) -> torch.Tensor:
    """RoPE over packed sequences ([t, heads, d], megatron's ``fused_apply_rotary_pos_emb_thd`` hook): positions
    restart at every ``cu_seqlens`` boundary, as megatron's unfused per-sequence loop does, in one kernel."""
    if cp_size != 1:
        raise NotImplementedError("the fused packed-sequence RoPE here has no context parallelism")
    if kwargs.get("interleaved") or freqs.shape[-1] != t.shape[-1]:  # the general form, per position
        return _rope_bshd(t.unsqueeze(1), freqs[_positions(cu_seqlens, t.shape[0])], **kwargs).squeeze(1)
    return _rotated(t.unsqueeze(1), *_cos_sin.get(t.dtype, freqs, cu_seqlens, t.shape[0])).squeeze(1)


def _split_rope(
    mixed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_per_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's QKV projection [s, b, groups, (heads_per_group + 2) * d] (each group's queries, then its key and
    value) as rotated queries [s, b, heads, d], rotated keys and values [s, b, groups, d], each contiguous; cos and
    sin [s, 1, 1, d]."""
    s, b, groups, width = mixed.shape
    x = mixed.view(s, b, groups, heads_per_group + 2, width // (heads_per_group + 2))
    queries = _rotate_half(x[:, :, :, :heads_per_group], cos.unsqueeze(3), sin.unsqueeze(3))
    keys = _rotate_half(x[:, :, :, heads_per_group], cos, sin)
    values = x[:, :, :, heads_per_group + 1].clone(memory_format=torch.contiguous_format)
    return queries.reshape(s, b, groups * heads_per_group, -1), keys, values


_split_rope_compiled = torch.compile(_split_rope)


def split_rope(
    mixed: torch.Tensor,
    freqs: torch.Tensor,
    heads_per_group: int,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_split_rope`` by the angles ``freqs`` [s, 1, 1, d] (packed: positions restart at every ``cu_seqlens``
    boundary), one kernel on GPUs. megatron's own split copies the queries out of the projection (a reshape of a
    strided slice) and its RoPE reads and writes them again; here the projection is read once, and the backward
    writes its gradient in one pass where megatron's concatenates the three."""
    cos, sin = _cos_sin.get(mixed.dtype, freqs, cu_seqlens, mixed.shape[0])
    if not compiles(mixed):
        return _split_rope(mixed, cos, sin, heads_per_group)
    return _split_rope_compiled(token_dims(mixed, 0, 1), token_dims(cos, 0), token_dims(sin, 0), heads_per_group)


def install_fused_rope() -> None:
    """Fill megatron's ``apply_rope_fusion`` hooks (padded and packed) with the compiled RoPE where TE has not."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = _rope_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = _rope_thd


def varlen_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor | None:
    """Causal attention over packed sequences ([t, heads, d]) in one flash kernel (``torch.nn.attention.varlen``);
    None where that cannot run (a CPU, fp32, a torch without it). Its keywords changed between torch 2.10 and
    2.12 (``is_causal`` became ``window_size``, ``scale`` and ``enable_gqa`` were added): read them off it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-9:
        return None
    cu = cu_seqlens.to(torch.int32)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" not in params:
            # torch 2.11's varlen_attn takes no grouped heads, the flash kernel under it does: on an H200 at
            # 32,768 tokens (12 query over 2 KV heads of 128) 1.59 ms a layer forward and backward against
            # 1.84 with the heads repeated (two copies of K and V forward, two sums backward), outputs and
            # gradients bitwise equal
            return torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale
            )[0]
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


PRODUCTS_ATTENTION_BYTES = 64 << 20
"""The largest fp32 scores [b, heads, s, s] a layer's ``causal_attention_by_products`` writes (and autograd keeps
for the backward, with their bf16 copy): past it, torch's flash kernel."""


def causal_attention_by_products(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention of rows q [b, heads, s, d] over keys and values [b, kv_heads, s, d] as two batched products
    per KV head (its group of query heads as one matrix; the scale and the mask in the first), the softmax in
    fp32; None on GPUs or where the scores would pass ``PRODUCTS_ATTENTION_BYTES``. torch's CPU flash kernel is
    made for long sequences: on 2 EPYC cores, the demo's [8 rows, 9 heads over 3, 196, 64] in bf16 took 17.9-18.1
    ms forward and backward, these products 6.7, and they are closer to fp32's outputs and gradients (max error
    0.031 against the kernel's 0.062)."""
    b, heads, s, d = q.shape
    kv_heads, group = k.shape[1], heads // k.shape[1]
    if q.is_cuda or b * heads * s * s * 4 > PRODUCTS_ATTENTION_BYTES:
        return None
    # a KV head's query heads one after another: [b * kv_heads, group * s, d], each query row's mask repeated
    grouped = q.reshape(b * kv_heads, group * s, d)
    causal = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1).repeat(group, 1)
    scores = torch.baddbmm(causal, grouped, k.reshape(b * kv_heads, s, d).transpose(1, 2), alpha=scale)
    # compiled, one pass each way: the demo's layer forward and backward took 7.4 ms against 13.4 eager
    weights = _softmax_in_fp32_compiled(token_dims(scores, 0, 1, 2)) if compiles(scores) else _softmax_in_fp32(scores)
    return (weights @ v.reshape(b * kv_heads, s, d)).view(b, heads, s, d)


def _softmax_in_fp32(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, -1, dtype=torch.float32).to(scores.dtype)


_softmax_in_fp32_compiled = torch.compile(_softmax_in_fp32)


def _swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """megatron's ``swiglu_back`` (y = [gate, up], g = d silu(gate) * up), each half of the gradient stored by the
    same kernel from one read of ``g`` and ``y``; megatron's ``torch.cat`` form reads them again for each half."""
    gate, up = torch.chunk(y, 2, -1)
    sig = torch.sigmoid(gate)
    out = torch.empty_like(y)
    d_gate, d_up = torch.chunk(out, 2, -1)
    d_gate.copy_(g * sig * (1 + gate * (1 - sig)) * up)
    d_up.copy_(g * gate * sig)
    return out


_swiglu_back_compiled = torch.compile(_swiglu_back)


def install_swiglu_back() -> None:
    """Put ``_swiglu_back``, compiled, where megatron's SwiGLU autograd function looks its backward up."""
    from megatron.core.fusions import fused_bias_swiglu

    fused_bias_swiglu.swiglu_back = _swiglu_back_compiled


def _add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x + bias


_add_bias_compiled = torch.compile(_add_bias)


def install_bias_add() -> None:
    """megatron's linears add their bias (Qwen2's QKV) after the GEMM, a broadcasting add that torch runs through
    its generic element-wise kernel: on an H200 161 us at 32,768 x 2,048 against 66 us compiled, 71 ms of a 1.5B
    GRPO step before. Their forwards here run the GEMM without the bias and add it in one compiled kernel on GPUs; the
    backward is megatron's own, told the bias is there (``ctx.use_bias``)."""
    from megatron.core.tensor_parallel import layers

    for cls in (layers.LinearWithFrozenWeight, layers.LinearWithGradAccumulationAndAsyncCommunication):
        forward = cls.forward
        if getattr(forward, "adds_bias_compiled", False):
            continue

        def with_bias(ctx, input, weight, bias, *args, _forward=forward):
            out = _forward(ctx, input, weight, None, *args)
            if bias is None:
                return out
            ctx.use_bias = True
            if not compiles(out):
                return _add_bias(out, bias)
            return _add_bias_compiled(token_dims(out, *range(out.dim() - 1)), bias)

        with_bias.adds_bias_compiled = True
        cls.forward = staticmethod(with_bias)


def _wgrad_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad (fp32) += grad_output^T @ total_input (16-bit), accumulated inside the GEMM."""
    torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


def _wgrad_accum_16bit(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.addmm_(grad_output.t(), total_input)


def install_wgrad_accumulation() -> bool:
    """Register the weight-gradient kernels megatron expects from Apex; False where torch cannot serve
    them (checked on a small GEMM against a plain fp32 one, so a torch without the op never gets here)."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return True
    try:
        a = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
        acc = torch.ones(48, 32, device="cuda")
        _wgrad_accum_fp32(a, g, acc)
        if not torch.allclose(acc, 1 + g.float().t() @ a.float(), atol=1e-2, rtol=1e-3):
            return False
    except (RuntimeError, TypeError):
        return False
    module = types.ModuleType("fused_weight_gradient_mlp_cuda")
    module.wgrad_gemm_accum_fp32 = _wgrad_accum_fp32
    module.wgrad_gemm_accum_fp16 = _wgrad_accum_16bit
    sys.modules[module.__name__] = module
    layers.fused_weight_gradient_mlp_cuda = module
    layers._grad_accum_fusion_available = True
    return True


def _accumulate(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    main_grad.add_(grad)


_accumulate_compiled = torch.compile(_accumulate)


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor) -> bool:
    """main_grad (fp32) += grad (bf16) in one compiled pass where ``compiles`` says so; False (nothing done)
    elsewhere. torch's eager add on a CPU first writes grad out in fp32: for the demo's 135M parameters, 48 ms
    a micro-batch against 22 compiled (2 EPYC cores)."""
    if grad.is_cuda or not compiles(grad) or not (main_grad.is_contiguous() and grad.is_contiguous()):
        return False
    _accumulate_compiled(token_dims(main_grad.view(-1), 0), token_dims(grad.view(-1), 0))
    return True


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Apex's ``multi_tensor_l2norm`` contract, (global L2 norm as a 1-element fp32 tensor, None), in a few
    foreach kernels. megatron's own fallback takes one norm per tensor and then builds a tensor from their
    values, a device-to-host copy per parameter."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def _scale(chunk_size, noop_flag, tensor_lists, scale):
    """Apex's ``multi_tensor_scale``: dst = src * scale, in foreach kernels."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def install_optimizer_kernels() -> None:
    """Swap megatron's per-tensor grad-norm and scale fallbacks (used without TE/Apex) for foreach kernels;
    on CPUs as on GPUs, so the tests run this path."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _scale


def use_fused_adam(megatron_optimizer) -> bool:
    """Step torch's AdamW with its fused kernel (megatron builds it with the default, per-tensor foreach
    one, when TE/Apex are missing), after building the optimizer and after loading a checkpoint into it.
    The fused kernel wants Adam's ``step`` counters on the parameters' device, where the foreach one (and a
    checkpoint written by it) keeps them on the host. False where there is no torch Adam to switch."""
    inner = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    adams = [
        o.optimizer for o in inner if isinstance(getattr(o, "optimizer", None), torch.optim.Adam | torch.optim.AdamW)
    ]
    params = [p for opt in adams for group in opt.param_groups for p in group["params"]]
    if not params or not all(p.is_floating_point() and p.device == params[0].device for p in params):
        return False
    for opt in adams:
        for group in opt.param_groups:
            group["fused"], group["foreach"] = True, False
            for p in group["params"]:
                state = opt.state.get(p, {})
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return True


def fusion_flags(overrides: dict, dtype: torch.dtype) -> dict:
    """The TransformerConfig flags for the kernels available here, installing what they need; the run's
    ``override_transformer_config`` (``overrides``) still wins. On a CPU: bf16 weights packed where oneDNN can
    (``packed.install``), and the compiled element-wise kernels in bf16 where a C++ compiler is found
    (``compiles``); an fp32 model gets neither."""
    global _compile_on_cpu
    flags = {"bias_activation_fusion": True, "apply_rope_fusion": True}
    if torch.cuda.is_available():
        install_fused_rope()
        install_swiglu_back()
        install_bias_add()
        if install_wgrad_accumulation():
            flags["gradient_accumulation_fusion"] = True
        return flags
    if packed.can_pack(torch.device("cpu"), dtype):
        packed.install()
    if dtype != torch.bfloat16 or not can_compile_on_cpu():
        if overrides.get("apply_rope_fusion"):  # asked for on a CPU: our RoPE serves it there too, eagerly
            install_fused_rope()
        return {}
    _compile_on_cpu = True
    install_fused_rope()
    install_bias_add()
    # SwiGLU's backward stays megatron's (its two halves concatenated, compiled): on 2 EPYC cores at the demo's
    # [1,568 x 3,072], 0.8-1.0 ms against 1.8-2.0 for ``_swiglu_back``, whose two stores into halves were
    # measured faster on GPUs only
    return flags
