"""Fused kernels for megatron-core without Transformer Engine or Apex, built from torch on GPUs.

megatron takes its fused kernels from TE or Apex and refuses the flags that ask for them when neither is
installed; on a plain PyPI install every element-wise chain of a layer is then five to seven passes
over its activations, and every weight gradient an extra pass over fp32 memory. ``fusion_flags()`` turns
on what torch can provide instead, on GPUs only (on a CPU compiling costs more than it saves):

- RMSNorm: one ``torch.compile``d kernel each way (used by ``spec.RMSNorm``);
- RoPE: a compiled rotate-half, given to megatron through its ``apply_rope_fusion`` hook
  (``rope_utils.fused_apply_rotary_pos_emb``, which TE would fill);
- SwiGLU: megatron's own ``bias_activation_fusion`` (its ``jit_fuser`` is ``torch.compile``);
- weight-gradient accumulation: ``gradient_accumulation_fusion`` writes each weight gradient straight
  into its fp32 ``main_grad`` from the GEMM (cuBLAS with bf16 inputs and an fp32 accumulator, through
  ``torch.addmm(..., out_dtype=float32)``) instead of a bf16 gradient plus an fp32 add, which for a 7B
  model is ~75 GB of memory traffic per micro-batch. megatron reads the kernel from Apex's
  ``fused_weight_gradient_mlp_cuda``; we register a module of that name.
"""

import sys
import types

import torch


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama/Qwen RMSNorm: normalise in fp32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


_rms_norm_compiled = torch.compile(_rms_norm, dynamic=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (_rms_norm_compiled if x.is_cuda else _rms_norm)(x, weight, eps)


def _rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """megatron's unfused ``_apply_rotary_pos_emb_bshd`` (rotate-half), for megatron's [s, b, heads, d] with
    freqs [s, 1, 1, d] as for the engine's [b, heads, s, d] with freqs [b, 1, s, d]."""
    if interleaved:
        raise NotImplementedError("the fused RoPE here is for rotate-half (Llama/Qwen) layouts only")
    rot = freqs.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    out = t * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


_rope_compiled = torch.compile(_rope, dynamic=True)


def rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``t`` by the angles ``freqs`` (broadcast against it), cos/sin in ``t``'s dtype as HF."""
    return (_rope_compiled if t.is_cuda else _rope)(t, freqs)


def install_fused_rope() -> None:
    """Fill megatron's ``apply_rope_fusion`` hook with the compiled RoPE where TE has not."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = _rope_compiled


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


def fusion_flags(overrides: dict) -> dict:
    """The TransformerConfig flags for the kernels available here, installing what they need; the run's
    ``override_transformer_config`` (``overrides``) still wins. None on a CPU."""
    if not torch.cuda.is_available():
        if overrides.get("apply_rope_fusion"):  # asked for on a CPU: the compiled RoPE serves it there too
            install_fused_rope()
        return {}
    install_fused_rope()
    flags = {"bias_activation_fusion": True, "apply_rope_fusion": True}
    if install_wgrad_accumulation():
        flags["gradient_accumulation_fusion"] = True
    return flags
