"""The megatron-core layer spec this project trains with, and the modules it swaps into it.

megatron's local spec (no Transformer Engine) has two problems for us: its ``DotProductAttention``
materialises the [b, heads, s, s] score matrix (slow and memory-hungry; measured on an H200 at
28,100 vs 37,498 tokens/s with SDPA) and refuses packed sequences, and its torch norms refuse
``sequence_parallel=True``. So we take megatron's own local spec (its MLP / MoE parts differ between
megatron-core 0.16 and 0.19, and taking them from megatron keeps both working) and replace:

- core attention with ``SDPAttention`` (``torch.nn.functional.scaled_dot_product_attention``,
  grouped-query heads passed as they are, no KV expansion);
- every norm (input, pre-MLP, final, Q/K) with ``RMSNorm``, which computes in fp32 like Hugging Face
  and marks its weight for the sequence-parallel gradient all-reduce;
- self-attention with ``SplitRopeSelfAttention``, which with ``apply_rope_fusion`` on rotates the queries and
  keys as it splits the QKV projection (one kernel where megatron runs a copy and two RoPE kernels).

On GPUs the RMSNorm is one compiled kernel each way (models/fused.py, with the other kernels megatron
would take from Transformer Engine or Apex).

With Transformer Engine installed (and ``use_te`` not False) megatron's TE spec is used instead.
"""

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from grpo_core.models import context_parallel, fused
from grpo_core.models.shape import ModelShape

if not hasattr(moe_utils, "te_general_gemm"):
    # megatron-core 0.16.1 reads this name in the MoE router but defines it only when TE imports
    # (NameError without TE); 0.19 sets it to None, as we do here.
    moe_utils.te_general_gemm = None


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def use_transformer_engine(use_te: bool | None) -> bool:
    """None means "if installed"; True insists on it."""
    if use_te and not have_te():
        raise ImportError("use_te=True but transformer_engine is not importable")
    return have_te() if use_te is None else use_te


def gpt_layer_spec(shape: ModelShape, use_te: bool | None = None) -> ModuleSpec:
    """A ``TransformerLayer`` spec for ``shape``: SwiGLU MLP or Qwen3-MoE experts (``SequentialMLP``)."""
    num_experts = shape.num_experts or None
    if use_transformer_engine(use_te):
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm
        )
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm, normalization="RMSNorm"
    )
    layer = spec.submodules
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    layer.self_attention.module = SplitRopeSelfAttention
    attention = layer.self_attention.submodules
    attention.core_attention = SDPAttention
    if shape.qk_norm:
        attention.q_layernorm = RMSNorm
        attention.k_layernorm = RMSNorm
    if num_experts:
        # TE keeps the MoE pre-MLP norm as its own module: name it the same way in distributed checkpoints.
        layer.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
    return spec


def final_norm(use_te: bool | None = None) -> type:
    """The norm class after the last layer (``TransformerBlockSubmodules.layer_norm``)."""
    if use_transformer_engine(use_te):
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return RMSNorm


class RMSNorm(torch.nn.Module):
    """Hugging Face's Llama/Qwen RMSNorm as a megatron norm: ``(config, hidden_size, eps)``.

    Normalises in fp32, casts back to the input dtype, then multiplies by the weight (in that order,
    as ``LlamaRMSNorm`` does, so logits match). With sequence parallelism each TP rank sees a
    different slice of the sequence, so the replicated weight's gradient must be summed over the TP
    group: ``finalize_model_grads`` does that for parameters marked ``sequence_parallel`` (as
    megatron's Apex and TE norms mark theirs).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"RMSNorm used with config.normalization={config.normalization!r}")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


class SplitRopeSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` with RoPE applied where the QKV projection is split (``fused.split_rope``).

    Taken where ``apply_rope_fusion`` is on and the layer's RoPE is a plain rotate-half over whole heads (no
    partial rotation, interleaving, YaRN scale, Q/K norm, output gate, context parallelism, inference context,
    or TP above the KV heads); elsewhere megatron's own path runs unchanged. ``forward`` keeps the angles from
    megatron's RoPE step (which then has nothing to do) for ``get_query_key_value_tensors`` to use.
    """

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.rope_at_split = (
            config.apply_rope_fusion
            and not config.rotary_interleaved
            and not getattr(config, "no_rope_freq", None)
            and not getattr(config, "attention_output_gate", False)
            and not hasattr(config, "yarn_rotary_scaling_factor")
            and config.context_parallel_size == 1
            and config.num_query_groups >= self.world_size
            and all(norm is None or isinstance(norm, IdentityOp) for norm in (self.q_layernorm, self.k_layernorm))
        )
        self._angles: tuple | None = None

    def forward(self, hidden_states, *args, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        if (
            self.rope_at_split
            and isinstance(rotary_pos_emb, torch.Tensor)
            and rotary_pos_emb.shape[-1] == self.hidden_size_per_attention_head
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
            and getattr(packed_seq_params, "qkv_format", "thd") == "thd"
        ):
            self._angles, rotary_pos_emb = (rotary_pos_emb, packed_seq_params), None
        try:
            return super().forward(
                hidden_states, *args, rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params, **kwargs
            )
        finally:
            self._angles = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if self._angles is None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        mixed, _ = super().get_query_key_value_tensors(hidden_states, key_value_states, split_qkv=False)
        freqs, packed = self._angles
        cu_seqlens = None
        if packed is not None:  # megatron's RoPE takes the padded offsets where there are
            cu_seqlens = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
        heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        return fused.split_rope(mixed, freqs, heads_per_group, cu_seqlens)


class SDPAttention(MegatronModule):
    """Core attention through ``scaled_dot_product_attention``; a drop-in for megatron's ``DotProductAttention``.

    Inputs are [s, b, heads, head_dim] (``thd`` packed: [t, heads, head_dim]); the output is [s, b, heads*head_dim].
    Masks: a given ``attention_mask`` (bool, True = masked, broadcastable to [b, heads, s, s]) is applied
    as is; with no mask, ``attn_mask_type=causal`` runs SDPA's ``is_causal`` path (flash kernels on GPU).
    Packed sequences run torch's variable-length flash kernel on GPUs, elsewhere one causal SDPA call per
    sequence of ``cu_seqlens_q`` (padded offsets when given). With context parallelism (not packed) the keys and
    values are gathered from every CP rank and the queries, this rank's chunks, attend to the whole sequence
    (models/context_parallel.py); a given mask is then [b, 1, local queries, whole sequence].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("SDPAttention has no sliding-window attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"SDPAttention supports softmax_type='vanilla' only, not {config.softmax_type!r}")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = config.kv_channels**-0.5 if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not take an attention_bias")
        dropout = self.dropout if self.training else 0.0
        if dropout > 0 and not self.config.sequence_parallel:
            # Heads differ across TP ranks, so their dropout masks must too (as DotProductAttention does).
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self._attend(query, key, value, attention_mask, attn_mask_type, packed_seq_params, dropout)
        return self._attend(query, key, value, attention_mask, attn_mask_type, packed_seq_params, dropout)

    def _attend(self, query, key, value, attention_mask, attn_mask_type, packed_seq_params, dropout):
        if packed_seq_params is not None:
            return self._attend_packed(query, key, value, packed_seq_params, dropout)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        s, b = query.shape[:2]
        if self.config.context_parallel_size > 1:
            key, value = (context_parallel.gather(t, 0, sum_grads=True) for t in (key, value))
            if attention_mask is None and mask_type == AttnMaskType.causal:
                attention_mask = context_parallel.causal_mask(s, query.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be bool (True = masked), got {attention_mask.dtype}")
            out = self._sdpa(q, k, v, dropout, attn_mask=~attention_mask)
        elif mask_type == AttnMaskType.causal:
            out = self._sdpa(q, k, v, dropout, is_causal=True)
        elif mask_type == AttnMaskType.no_mask:
            out = self._sdpa(q, k, v, dropout)
        else:
            raise ValueError(f"attn_mask_type={mask_type} needs an attention_mask")
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _attend_packed(self, query, key, value, params, dropout):
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("packed sequences with context parallelism: the actor packs only at CP=1")
        if getattr(params, "qkv_format", "thd") != "thd":
            raise NotImplementedError(f"packed qkv_format {params.qkv_format!r}: only 'thd' is supported")
        padded = params.cu_seqlens_q_padded
        cu = padded if padded is not None else params.cu_seqlens_q
        if dropout == 0:
            out = fused.varlen_causal_attention(query, key, value, cu, params.max_seqlen_q, self.softmax_scale)
            if out is not None:
                return out.reshape(query.shape[0], -1)
        # elsewhere (CPUs, fp32) the sequences side by side as rows, left-aligned: a row's padding comes after its
        # tokens, so the causal mask alone keeps it out of every real query's attention; one batched call instead of
        # one per sequence (on 2 CPU cores, 16 sequences of ~200 tokens: ~5x faster forward and backward)
        bounds = cu.tolist()
        starts = torch.tensor(bounds[:-1])
        lengths = torch.tensor(bounds[1:]) - starts
        rows, width = len(bounds) - 1, max(int(lengths.max()), 1)
        sequence = torch.repeat_interleave(torch.arange(rows), lengths)  # each token's sequence
        slots = sequence * width + torch.arange(bounds[0], bounds[-1]) - starts[sequence]  # its place among the rows
        slots = slots.to(query.device)

        def as_rows(t):  # [t, heads, d] -> [rows, heads, width, d]
            padded = t.new_zeros(rows * width, *t.shape[1:]).index_copy(0, slots, t[bounds[0] : bounds[-1]])
            return padded.view(rows, width, *t.shape[1:]).transpose(1, 2)

        rows_q, rows_k, rows_v = as_rows(query), as_rows(key), as_rows(value)
        out = fused.causal_attention_by_products(rows_q, rows_k, rows_v, self.softmax_scale) if not dropout else None
        if out is None:
            out = self._sdpa(rows_q, rows_k, rows_v, dropout, is_causal=True)
        packed = out.transpose(1, 2).reshape(rows * width, -1).index_select(0, slots)  # [tokens in sequences, h*d]
        before, after = bounds[0], query.shape[0] - bounds[-1]  # tokens outside every sequence: zeros
        return torch.nn.functional.pad(packed, (0, 0, before, after)) if before or after else packed

    def _sdpa(self, q, k, v, dropout, attn_mask=None, is_causal=False):
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
