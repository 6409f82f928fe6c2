"""Our own rollout engine: a static KV cache, one batched decode step, replayed as a CUDA graph.

Why it exists: ``transformers.generate`` spends ~90 ms per decode step in Python and kernel launches
whatever the batch (../shared/notes/gpu-baseline.md), vLLM is not installable everywhere, and
megatron-core's dynamic engine needs flash-attn. A decode step here is a fixed sequence of kernels over
preallocated buffers, so on a GPU it is captured as a CUDA graph and replayed: one launch per token
for the whole batch.

How a ``generate`` call runs, per chunk of at most ``max_batch_size`` rows (whole prompts each):
1. prefill each distinct prompt once (left-padded, SDPA with a causal + padding mask) and cache its
   keys/values: in the first of its ``n`` rows for the cascade attention, in every row for SDPA;
2. sample the first token from the prompt's last logits (``sampler``: no host round trip, so graph-safe);
3. replay the decode step: write the token's K/V at the next cache slot, attend (on GPUs the cascade of
   ``decode_attention``: a prompt's keys read once for its samples, one graph per chunk; else SDPA, on CPUs two
   batched products, over each row's cache up to the smallest multiple of ``LENGTH_BUCKET`` covering the slots
   written so far, one graph per such length), sample the next token, advance; every 32 steps stop early if
   every row has met a stop token.

It runs the dense Llama / Qwen2 / Qwen3 decoders the actor trains, from HF-named weights stored fused
(QKV and gate/up each one matrix). ``update_weights`` copies into those buffers in place, so captured
graphs stay valid. On a CPU (the demo, tests) the same step runs eagerly, or, with bf16 weights packed for oneDNN
and a C++ compiler for torch.compile, each layer compiled whole (``one_token_layer``).
"""

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError
from torch.nn.attention import SDPBackend, sdpa_kernel

from grpo_core.config.defaults import SETTING, defaults_from
from grpo_core.models.fused import can_compile_on_cpu, rms_norm, rope
from grpo_core.models.packed import can_pack, pack, packed_linear
from grpo_core.models.shape import ModelShape
from grpo_core.rollout import decode_attention
from grpo_core.rollout.base import DTYPES, Generation, SamplingSettings, generate_in_chunks
from grpo_core.rollout.sampler import sample_compiled, sample_on_cpu

EARLY_STOP_EVERY = 32  # decode steps between checks (a host sync) that every row has stopped
# cache lengths attended to are rounded up to this, so few graphs are captured; on an H200 at 512 rows a decode
# step's attention took 1.41 ms with 64, 1.57 ms with 128 (fewer unwritten slots read)
LENGTH_BUCKET = 64


def mlp_block(x, attended, o, post_norm, gate_up, down, eps: float, linear=F.linear) -> torch.Tensor:
    """The rest of a layer after attention (attended [b, s, heads*d]): o_proj, residual, SwiGLU MLP, residual.
    ``linear``: ``packed_linear`` where the weights are packed for the CPU."""
    x = x + linear(attended, o)
    gate, up = linear(rms_norm(x, post_norm, eps), gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, down)


# On GPUs the element-wise work between the GEMMs is fused (measured at 2,048 rows: ~10 of the decode
# step's 25.8 ms were element-wise kernels); the same functions run eagerly on CPUs.
_mlp_block_compiled = torch.compile(mlp_block)  # sizes that change (rows, tokens) turn symbolic after one recompile


def attention_inputs(x, w: dict, cos, sin, heads: int, kv_heads: int, eps: float, linear=F.linear):
    """x [b, s, hidden] -> q [b, heads, s, d] and keys-then-values [b, 2 * kv_heads, s, d], rotated, for the layer
    whose tensors are ``w`` (``StaticEngine._prepared``)."""
    b, t, _ = x.shape
    qkv = linear(rms_norm(x, w["input_norm"], eps), w["qkv"], w.get("qkv_bias"))
    qkv = qkv.view(b, t, heads + 2 * kv_heads, -1).transpose(1, 2)  # [b, all heads, t, d]
    if "q_norm" in w:
        q, k, v = qkv.split([heads, kv_heads, kv_heads], 1)
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
        return rope(q, cos, sin), torch.cat((rope(k, cos, sin), v), 1)
    # queries and keys rotated, values copied, in one kernel: the cache takes keys and values in one copy
    q, kv = rope(qkv, cos, sin, rotated=heads + kv_heads).split([heads, 2 * kv_heads], 1)
    return q, kv


def finish_layer(x, attended, w: dict, eps: float, linear=F.linear) -> torch.Tensor:
    """attended [b, heads, s, d] -> the layer's output: o_proj, residual, SwiGLU MLP, residual."""
    b, _, t, _ = attended.shape
    flat = attended.transpose(1, 2).reshape(b, t, -1)
    block = _mlp_block_compiled if x.is_cuda else mlp_block
    return block(x, flat, w["o"], w["post_norm"], w["gate_up"], w["down"], eps, linear=linear)


def one_token_layer(
    x, cache, slot, cos, sin, bias, w: dict, heads: int, kv_heads: int, eps: float,
    linear=packed_linear, attend=decode_attention.summed_attention,
) -> torch.Tensor:  # fmt: skip
    """A CPU decode step's layer: rows of one token x [b, 1, hidden] write their keys and values at ``slot`` and
    attend over the cache's first ``bias.shape[-1]`` slots. Compiled whole (``_one_token_layer_compiled``, the
    defaults: the matrices ``pack``ed, attention as sums); eagerly, ``grouped_matmul_attention``. Eagerly, a layer
    of the demo's step (SmolLM2-135M, 16 rows) was ~30 operator calls around 4 products; compiled, 6 loops of C++
    and the products (bench/cpu_step.py)."""
    q, kv = attention_inputs(x, w, cos, sin, heads, kv_heads, eps, linear)
    cache[: x.shape[0]].index_copy_(2, slot, kv)
    keys, values = cache[: x.shape[0], :, : bias.shape[-1]].split(kv_heads, 1)  # [b, kv, L, d] each
    return finish_layer(x, attend(q, keys, values, bias), w, eps, linear)


_one_token_layer_compiled = torch.compile(one_token_layer)  # rows and attended length turn symbolic when they change


def unsupported(
    shape: ModelShape, key: str = "actor_rollout_ref.rollout.name", instead: str = "vllm or hf"
) -> str | None:
    """Why the static engine cannot run ``shape`` (None: it can), said for the config ``key`` that chose it."""
    if shape.is_moe or shape.rope_scaling_factor is not None or shape.model_type not in ("llama", "qwen2", "qwen3"):
        extra = " (MoE)" if shape.is_moe else " (RoPE scaling)" if shape.rope_scaling_factor else ""
        return (
            f"{key}=static runs dense Llama/Qwen2/Qwen3 without RoPE scaling, not this {shape.model_type}"
            f"{extra}: use {key}={instead}"
        )
    return None


class StaticEngine:
    """Implements ``RolloutEngine`` for dense Llama/Qwen2/Qwen3 models; weights come from ``update_weights``
    (the trainer pushes the actor's) or ``load(model_dir)``."""

    @defaults_from("actor_rollout_ref.rollout")
    def __init__(
        self,
        shape: ModelShape,
        stop_ids: list[int],
        dtype: str = SETTING,
        device: str = "cpu",
        max_batch_size: int = 256,
        max_model_len: int = 2048,
        cuda_graphs: bool = True,
        grow_length: bool = True,
        attention: str = "auto",
        pack_weights: bool | None = None,
        compile_decode: bool | None = None,
    ) -> None:
        """``grow_length``: each decode step attends over the cache written so far (rounded up to LENGTH_BUCKET),
        with one CUDA graph per such length; off, every step of a chunk attends over the chunk's whole length
        through one graph. Off is faster for an engine put to sleep after every rollout, whose graphs are
        recaptured at each wake: on one H200 (Qwen2.5-1.5B, 512 rows x 256 tokens) a GRPO step's generation
        took 2.6-3.0 s with a graph per length recaptured, 1.9-2.0 s with one, 1.7-1.8 s with per-length graphs
        kept.

        ``attention``: "cascade" (``decode_attention``: each prompt's keys read once for its samples, one graph per
        chunk shape), "sdpa" (torch's, row by row, a graph per attended length), or "auto": the cascade where CUDA
        graphs replay it (eagerly, its Triton launches cost more host time than the step saves).

        ``pack_weights``: the matrices' weights also held in oneDNN's layout (``pack``; twice the weights' memory),
        by default on CPUs with bf16 matrix instructions running bf16; repacked after each ``update_weights``.

        ``compile_decode``: a CPU decode step's layers compiled whole (``one_token_layer``), by default where the
        weights are packed and torch.compile finds its C++ compiler. The first step compiles (~8 s, then from
        torch's cache on disk)."""
        if problem := unsupported(shape):
            raise NotImplementedError(problem)
        self.shape, self.stop_ids = shape, list(stop_ids)
        self.dtype, self.device = DTYPES[dtype], torch.device(device)
        self.max_batch_size, self.max_model_len = max_batch_size, max_model_len
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.grow_length = grow_length
        if attention not in ("auto", "cascade", "sdpa"):
            raise ValueError(f"attention={attention!r}: use auto, cascade or sdpa")
        fits = decode_attention.available(shape.head_dim)
        self.cascade = attention == "cascade" or (attention == "auto" and fits and self.cuda_graphs)
        if self.cascade and not fits:
            raise ValueError(f"attention=cascade needs Triton and a power-of-two head size, not {shape.head_dim}")
        self._params = self._allocate_params()
        self._targets = self._name_table()
        self.pack_weights = can_pack(self.device, self.dtype) if pack_weights is None else pack_weights
        if self.pack_weights and not can_pack(self.device, self.dtype):
            raise ValueError("pack_weights needs a CPU with oneDNN bf16 support and dtype bfloat16")
        self._linear = packed_linear if self.pack_weights else F.linear
        self._weights: tuple[list[dict[str, torch.Tensor]], torch.Tensor] | None = None  # see ``_prepared``
        self.compile_decode = self.pack_weights and can_compile_on_cpu() if compile_decode is None else compile_decode
        if self.compile_decode and not self.pack_weights:
            raise ValueError("compile_decode needs pack_weights")
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim)
        freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), inv_freq)
        self._angles = torch.cat((freqs, freqs), dim=-1).to(self.device)  # [max_model_len, head_dim], fp32
        self._cache: list[torch.Tensor] | None = None
        # (rows, new tokens, mode) -> (buffers, {attended length: step over those buffers})
        self._decoders: dict[tuple, tuple[dict, dict[int, Callable[[], None]]]] = {}
        self._pool = None
        self._timings: Counter[str] = Counter()

    # ---- weights ----------------------------------------------------------------------------------

    def _allocate_params(self) -> dict[str, torch.Tensor]:
        s, kw = self.shape, dict(dtype=self.dtype, device=self.device)
        qkv_rows = (s.num_attention_heads + 2 * s.num_kv_heads) * s.head_dim
        p = {"embed": torch.zeros(s.vocab_size, s.hidden_size, **kw), "norm": torch.ones(s.hidden_size, **kw)}
        p["lm_head"] = p["embed"] if s.tie_embeddings else torch.zeros(s.vocab_size, s.hidden_size, **kw)
        for i in range(s.num_layers):
            p[f"{i}.qkv"] = torch.zeros(qkv_rows, s.hidden_size, **kw)
            if s.qkv_bias:
                p[f"{i}.qkv_bias"] = torch.zeros(qkv_rows, **kw)
            if s.qk_norm:
                p[f"{i}.q_norm"] = torch.ones(s.head_dim, **kw)
                p[f"{i}.k_norm"] = torch.ones(s.head_dim, **kw)
            p[f"{i}.o"] = torch.zeros(s.hidden_size, s.num_attention_heads * s.head_dim, **kw)
            p[f"{i}.gate_up"] = torch.zeros(2 * s.ffn_hidden_size, s.hidden_size, **kw)
            p[f"{i}.down"] = torch.zeros(s.hidden_size, s.ffn_hidden_size, **kw)
            p[f"{i}.input_norm"] = torch.ones(s.hidden_size, **kw)
            p[f"{i}.post_norm"] = torch.ones(s.hidden_size, **kw)
        return p

    def _name_table(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> the view of our (fused) buffer it fills."""
        s, p = self.shape, self._params
        q, kv = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
        ffn = s.ffn_hidden_size
        table = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["norm"]}
        table["lm_head.weight"] = p["lm_head"]
        for i in range(s.num_layers):
            hf = f"model.layers.{i}."
            qkv = p[f"{i}.qkv"]
            table |= {
                hf + "self_attn.q_proj.weight": qkv[:q],
                hf + "self_attn.k_proj.weight": qkv[q : q + kv],
                hf + "self_attn.v_proj.weight": qkv[q + kv :],
                hf + "self_attn.o_proj.weight": p[f"{i}.o"],
                hf + "mlp.gate_proj.weight": p[f"{i}.gate_up"][:ffn],
                hf + "mlp.up_proj.weight": p[f"{i}.gate_up"][ffn:],
                hf + "mlp.down_proj.weight": p[f"{i}.down"],
                hf + "input_layernorm.weight": p[f"{i}.input_norm"],
                hf + "post_attention_layernorm.weight": p[f"{i}.post_norm"],
            }
            if s.qkv_bias:
                bias = p[f"{i}.qkv_bias"]
                table |= {
                    hf + "self_attn.q_proj.bias": bias[:q],
                    hf + "self_attn.k_proj.bias": bias[q : q + kv],
                    hf + "self_attn.v_proj.bias": bias[q + kv :],
                }
            if s.qk_norm:
                table[hf + "self_attn.q_norm.weight"] = p[f"{i}.q_norm"]
                table[hf + "self_attn.k_norm.weight"] = p[f"{i}.k_norm"]
        return table

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each HF-named tensor into its slice of our buffers (in place: captured graphs stay valid)."""
        self._weights = None
        for name, tensor in named_tensors:
            target = self._targets.get(name)
            if target is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise KeyError(f"update_weights: the model has no parameter named {name!r}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor, non_blocking=True)

    def load(self, model_dir: str | Path) -> "StaticEngine":
        """Weights from a HF safetensors checkpoint (for use outside the trainer, which pushes the actor's)."""
        from grpo_core.models.weights import HFCheckpoint

        with HFCheckpoint(model_dir) as ckpt:
            names = [n for n in ckpt.files if not (self.shape.tie_embeddings and n == "lm_head.weight")]
            self.update_weights((name, ckpt.full(name)) for name in names)
        return self

    # ---- memory -----------------------------------------------------------------------------------

    def _kv_cache(self) -> list[torch.Tensor]:
        """Per layer, keys and values in one tensor [rows, 2 * kv_heads, slots, d] (the keys' heads first): a decode
        step writes both with one copy."""
        if self._cache is None:
            s = self.shape
            size = (self.max_batch_size, 2 * s.num_kv_heads, self.max_model_len, s.head_dim)
            self._cache = [torch.zeros(size, dtype=self.dtype, device=self.device) for _ in range(s.num_layers)]
        return self._cache

    def sleep(self) -> None:
        """Free the KV cache and the graphs (they hold its addresses); the weights stay."""
        self._cache, self._decoders, self._pool = None, {}, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Nothing to do: the cache is allocated, and graphs captured, at the next ``generate``."""

    # ---- the model --------------------------------------------------------------------------------

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin [b, 1, s, d] at ``positions`` [b, s] in the model's dtype, for all layers of a forward."""
        angles = self._angles[positions].unsqueeze(1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def _prepared(self) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """Each layer's tensors by name (``attention_inputs``' keys) and the lm-head's matrix, the matrices
        ``pack``ed where the engine packs: made from the current weights if they changed since."""
        if self._weights is None:
            p = self._params
            matrices = ("qkv", "o", "gate_up", "down")
            optional = ("qkv_bias", "q_norm", "k_norm")
            names = ("input_norm", "post_norm", *matrices, *(n for n in optional if f"0.{n}" in p))
            layers = [
                {n: self._matrix(p[f"{i}.{n}"]) if n in matrices else p[f"{i}.{n}"] for n in names}
                for i in range(self.shape.num_layers)
            ]
            self._weights = layers, self._matrix(p["lm_head"])
        return self._weights

    def _matrix(self, weight: torch.Tensor) -> torch.Tensor:
        return pack(weight, self.max_batch_size) if self.pack_weights else weight

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, hidden] -> logits [b, vocab] in the model's dtype."""
        return self._linear(rms_norm(x, self._params["norm"], self.shape.norm_eps), self._prepared()[1])

    def _attention_inputs(self, i: int, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]):
        s = self.shape
        return attention_inputs(
            x, self._prepared()[0][i], *rotation, s.num_attention_heads, s.num_kv_heads, s.norm_eps, self._linear
        )

    def _finish_layer(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return finish_layer(x, attended, self._prepared()[0][i], self.shape.norm_eps, self._linear)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, rows_per_prompt: int) -> torch.Tensor:
        """Run left-padded prompts [u, P]; write their K/V into cache rows (n per prompt); last logits [u, V]."""
        u, width = ids.shape
        rotation = self._rotation((mask.cumsum(-1) - 1).clamp(min=0))
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        allowed = (causal[None] & mask[:, None, :].bool()) | torch.eye(width, dtype=torch.bool, device=ids.device)
        # as an additive bias [u, 1, P, P] (a padding query sees itself, so no row is empty), its rows 8-aligned
        # in memory as the memory-efficient kernel needs (else torch pads a copy, with a warning, every layer)
        aligned = -(-width // 8) * 8
        bias = torch.full((u, 1, width, aligned), float("-inf"), dtype=self.dtype, device=ids.device)[..., :width]
        bias.masked_fill_(allowed.unsqueeze(1), 0.0)
        x = F.embedding(ids, self._params["embed"])
        kv_heads = self.shape.num_kv_heads
        group = self.shape.num_attention_heads // kv_heads
        for i, cache in enumerate(self._kv_cache()):
            q, kv = self._attention_inputs(i, x, rotation)
            if self.cascade:  # it reads a prompt's keys and values from the prompt's first row only
                cache[: u * rows_per_prompt : rows_per_prompt, :, :width] = kv
            else:
                cache[: u * rows_per_prompt, :, :width] = kv.repeat_interleave(rows_per_prompt, dim=0)
            k, v = kv.split(kv_heads, 1)
            # torch's memory-efficient kernel (it takes no grouped heads, so they are repeated) rather than the
            # cuDNN one SDPA picks on an H200: cuDNN builds a graph per prompt width (0.07 s each on a warm
            # machine; on fresh ones the GRPO steps that met new widths spent 1.0-1.6 s more in prefill)
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = self._finish_layer(i, x, attended)
        return self._logits(x[:, -1])

    def _decode(self, st: dict, mode: tuple, length: int, rows_per_prompt: int) -> None:
        """One decode step over the static buffers in ``st`` (captured as a CUDA graph on GPUs)."""
        rows, limit = st["tokens"].shape
        if not self.cascade:
            st["bias"].index_fill_(1, st["slot"], 0.0)
        rotation = self._rotation(st["position"][:, None])
        x = F.embedding(st["token"][:, None], self._params["embed"])  # [b, 1, hidden]
        bias = st["bias"][:, None, None, :length]  # [b, 1, 1, L]: -inf at the prompt's padding and unwritten slots
        kv_heads = self.shape.num_kv_heads
        prompt_slots = self.max_model_len - limit  # the widest prompt a chunk of this shape can hold
        for i, cache in enumerate(self._kv_cache()):
            if not x.is_cuda and not self.cascade:  # (the cascade runs on a CPU in Triton's interpreter: tests)
                x = self._cpu_layer(x, cache, st["slot"], rotation, bias, self._prepared()[0][i])
                continue
            q, kv = self._attention_inputs(i, x, rotation)
            cache[:rows].index_copy_(2, st["slot"], kv)
            if self.cascade:
                attended = decode_attention.cascade_attention(
                    q[:, :, 0], cache[:rows], st["start"], st["width"], st["slot"], rows_per_prompt, prompt_slots
                ).unsqueeze(2)
            else:
                keys, values = cache[:rows, :, :length].split(kv_heads, 1)  # [b, kv, L, d] each
                # one query per row, grouped heads as they are; on an H200 torch picks cuDNN's kernel: 0.064 ms
                # a layer at 512 rows x 384 slots, against 0.100 ms for a compiled matmul + fp32 softmax
                attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=True)
            x = self._finish_layer(i, x, attended)
        self._sample(self._logits(x[:, 0]), st, mode)
        st["tokens"].index_copy_(1, st["step"], st["token"][:, None])
        st["log_probs"].index_copy_(1, st["step"], st["log_prob"][:, None])
        st["position"].add_(1)
        st["slot"].add_(1)
        st["step"].add_(1)

    def _cpu_layer(self, x, cache, slot, rotation, bias, w: dict) -> torch.Tensor:
        """``one_token_layer``, compiled where the engine compiles (``compile_decode``), else eagerly. If
        torch.compile fails here (a broken C++ toolchain), it says so once and decodes eagerly from then on: a
        failed compile runs nothing, so the layer is simply done again."""
        s = self.shape
        args = (x, cache, slot, *rotation, bias, w, s.num_attention_heads, s.num_kv_heads, s.norm_eps)
        if self.compile_decode:
            try:
                return _one_token_layer_compiled(*args)
            except (BackendCompilerFailed, InductorError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                print(
                    f"static engine: compiling the CPU decode step failed, decoding eagerly ({first})", file=sys.stderr
                )
                self.compile_decode = False
        return one_token_layer(*args, linear=self._linear, attend=decode_attention.grouped_matmul_attention)

    def _sample(self, logits: torch.Tensor, st: dict, mode: tuple) -> None:
        """Next token into st["token"] and its temperature-1 log-prob into st["log_prob"] (graph-safe: no syncs)."""
        token, log_prob = (sample_compiled if logits.is_cuda else sample_on_cpu)(logits, st["temperature"], *mode)
        st["token"].copy_(token)
        st["log_prob"].copy_(log_prob)

    # ---- generate ---------------------------------------------------------------------------------

    def _length(self, slot: int, last: int) -> int:
        """The cache length a decode step writing ``slot`` attends over (``last``: the chunk's last slot): the
        written slots rounded up to ``LENGTH_BUCKET``, so a chunk needs few graphs and no step reads much of the
        cache not yet written; without ``grow_length``, the whole chunk's. The cascade reads its bounds on the GPU:
        one length, one graph."""
        if self.cascade:
            return self.max_model_len
        covered = slot if self.grow_length else last
        return min(self.max_model_len, -(-(covered + 1) // LENGTH_BUCKET) * LENGTH_BUCKET)

    def _decoder(
        self, rows: int, limit: int, mode: tuple, rows_per_prompt: int, lengths: Iterable[int]
    ) -> tuple[dict, dict[int, Callable[[], None]]]:
        """The decode step's static buffers and a step over them per attended length in ``lengths``: on GPUs
        CUDA graphs captured over those buffers (replayed by every chunk of the same shape), elsewhere the
        eager step."""
        key = (rows, limit, mode, rows_per_prompt)
        if key not in self._decoders:
            self._decoders[key] = (self._buffers(rows, limit), {})
        st, steps = self._decoders[key]
        for length in lengths:
            if length not in steps:
                steps[length] = self._capture(partial(self._decode, st, mode, length, rows_per_prompt), st)
        return st, steps

    def _buffers(self, rows: int, limit: int) -> dict[str, torch.Tensor]:
        """The decode step's inputs, outputs and counters, at fixed addresses (the graphs read and write them)."""
        kw = dict(device=self.device)
        return {
            "token": torch.zeros(rows, dtype=torch.long, **kw),
            "log_prob": torch.zeros(rows, **kw),
            "position": torch.zeros(rows, dtype=torch.long, **kw),
            "slot": torch.zeros(1, dtype=torch.long, **kw),
            "step": torch.zeros(1, dtype=torch.long, **kw),
            "width": torch.zeros(1, dtype=torch.long, **kw),  # the chunk's prompt width: its first response slot
            "start": torch.zeros(rows, dtype=torch.long, **kw),  # each row's first prompt slot (left padding)
            # the attention mask as an additive bias in the model's dtype, kept step to step (a bool mask is
            # converted by every layer's SDPA: three kernels a layer)
            "bias": torch.zeros(rows, self.max_model_len, dtype=self.dtype, **kw),
            "temperature": torch.ones((), **kw),
            "tokens": torch.zeros(rows, limit, dtype=torch.long, **kw),
            "log_probs": torch.zeros(rows, limit, **kw),
        }

    def _capture(self, step: Callable[[], None], st: dict) -> Callable[[], None]:
        """``step`` as a CUDA graph in the shared pool (on CPUs, ``step`` itself). The warm-up before the
        capture is a real step: it advances ``st`` and writes a cache slot. So ``_decoder`` captures every
        length a chunk needs before ``_generate_chunk`` sets the buffers (simpler than saving and restoring
        them), and the counters restart at 0 here, so a warm-up stays inside ``st`` whatever ran before."""
        if not self.cuda_graphs:
            return step
        for counter in ("position", "slot", "step"):
            st[counter].zero_()
        self._kv_cache()  # allocated on this stream, before the warm-up below runs on a side stream
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (cuBLAS workspaces, lazy inits, compiling)
            step()
        torch.cuda.current_stream().wait_stream(side)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        return graph.replay  # the buffers' contents are set by _generate_chunk before every use

    @torch.no_grad()
    def _generate_chunk(self, prompts: list[list[int]], settings: SamplingSettings):
        n = settings.n
        rows, width = len(prompts) * n, max(len(p) for p in prompts)
        limit = settings.max_new_tokens
        if width + limit > self.max_model_len:
            raise ValueError(f"prompt ({width}) + max_new_tokens ({limit}) exceed max_model_len={self.max_model_len}")
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        mode = (settings.is_greedy, settings.top_k, settings.top_p)
        # the decode step producing response token p (p = 1 .. limit - 1) writes cache slot width + p - 1
        last = width + limit - 2
        start = self._mark()
        lengths = {self._length(slot, last) for slot in range(width, last + 1)}
        st, steps = self._decoder(rows, limit, mode, n, lengths)
        st["temperature"].fill_(1.0 if settings.is_greedy else settings.temperature)
        prefill = self._mark("rollout/capture_s", start)

        last_logits = self._prefill(ids, mask, n).repeat_interleave(n, dim=0)
        st["bias"].fill_(float("-inf"))
        st["bias"][:, :width].masked_fill_(mask.bool().repeat_interleave(n, dim=0), 0.0)
        st["position"].copy_(mask.sum(-1).repeat_interleave(n))
        st["slot"].fill_(width)
        st["width"].fill_(width)
        st["start"].copy_((width - mask.sum(-1)).repeat_interleave(n))
        self._sample(last_logits, st, mode)  # the first response token, from the prompt's last position
        st["tokens"][:, 0], st["log_probs"][:, 0] = st["token"], st["log_prob"]
        st["step"].fill_(1)
        stop = torch.tensor(self.stop_ids, device=self.device)
        produced = 1
        decode = self._mark("rollout/prefill_s", prefill)
        while produced < limit:
            if produced % EARLY_STOP_EVERY == 0 and bool(torch.isin(st["tokens"][:, :produced], stop).any(-1).all()):
                break
            steps[self._length(width + produced - 1, last)]()
            produced += 1
        tokens, log_probs = st["tokens"][:, :produced].cpu(), st["log_probs"][:, :produced].cpu()
        collect = self._mark("rollout/decode_s", decode)
        self._timings["rollout/decode_steps"] += produced - 1
        collected = self._collect(tokens, log_probs)
        self._mark("rollout/collect_s", collect)
        return collected

    def _mark(self, name: str | None = None, since: float = 0.0) -> float:
        """Now, with the GPU's queue drained; with ``name``, the seconds ``since`` added to that timing."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if name is not None:
            self._timings[name] += now - since
        return now

    def take_timings(self) -> dict[str, float]:
        """Where ``generate`` spent its time since the last call: graph captures, prefill, the decode loop, and
        cutting the responses at their stop tokens (the step logs them beside ``timing/gen``)."""
        taken, self._timings = dict(self._timings), Counter()
        return taken

    def _collect(self, tokens: torch.Tensor, log_probs: torch.Tensor):
        """Cut each row after its first stop token (lists whole, then sliced: a row at a time is ~25% slower)."""
        stops = torch.isin(tokens, torch.tensor(self.stop_ids))
        stopped = stops.any(-1)
        lengths = torch.where(stopped, stops.int().argmax(-1) + 1, tokens.shape[1]).tolist()
        responses = [row[:length] for row, length in zip(tokens.tolist(), lengths, strict=True)]
        token_log_probs = [row[:length] for row, length in zip(log_probs.tolist(), lengths, strict=True)]
        reasons = ["stop" if hit else "length" for hit in stopped.tolist()]
        return responses, token_log_probs, reasons

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> Generation:
        if settings.n > self.max_batch_size:
            raise ValueError(f"n={settings.n} samples per prompt exceed max_batch_size={self.max_batch_size}")
        per_chunk = self.max_batch_size // settings.n
        return generate_in_chunks(prompt_ids, settings, per_chunk, self.device, self._generate_chunk)
