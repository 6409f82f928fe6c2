"""Per-GPU memory of a GRPO step, phase by phase, from the model shape and the layout.

A colocated ("hybrid engine") GRPO step has three phases on the same GPUs: generation (the rollout
engine holds ``gpu_memory_utilization`` of the GPU for its weights and KV cache), log-probs (old and
reference, forward only) and the update (forward + backward + optimizer). Offload flags move state to
host memory *between* phases. ``optimizer_offload`` (a fraction: megatron's hybrid optimizer) keeps that
share of the Adam states in host memory and steps it there; what the optimizer keeps on the GPU (the fp32
master weights, which megatron's distributed optimizer holds there unless TE's precision-aware optimizer is
used, and the Adam states not offloaded) goes to host memory between updates, unless ``optimizer_stays``
(the hybrid optimizer asked for through override_optimizer_config, ``megatron.optimizer_offload`` off:
then that side stays on the GPU and the host holds only the hybrid optimizer's share). The hybrid optimizer's host
side is 16 bytes per offloaded parameter: a pinned fp32 copy and fp32 gradient per tensor, which torch's pinned
allocator rounds up to a power of two each (``pinned_rounding``: 1.89x for Qwen2.5-7B; megatron's
``pin_cpu_grads=false`` leaves the gradients pageable and unrounded), and two Adam moments in pageable memory.
On an H200 node with 125 GiB of host memory a 7B at fraction 0.5 trained and saved its checkpoint holding
~82 GB pinned and ~34 GB pageable; at 0.75 it was killed by the kernel's OOM killer.
The peak is the largest phase.

Activation sizes are per token and layer, in bytes of 16-bit activations: ``2 * (8h + 4kv + 3f)``
(h: hidden, kv: key/value width, f: MLP width), plus ``6 * heads * seq`` when the attention matrix is
materialised. The constants were fitted to measured H200 peaks (see ``tests/test_planning.py``);
``h``-sized terms are replicated across TP ranks unless sequence parallelism is on.
"""

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from grpo_core.config.defaults import SETTING, defaults_from, schema_default
from grpo_core.models.shape import ModelShape
from grpo_core.planning.layout import ParallelLayout, kv_heads_per_rank

GiB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GRAD_BYTES = 4  # megatron accumulates and reduces gradients in fp32 ("main_grad")
# Host bytes per parameter (of a GPU's TP/PP share, whatever the DP size) while megatron saves the distributed
# optimizer "fully_reshardable": every rank builds fp32 world copies of the parameters and both Adam moments
# (12 B) and the per-bucket shards and gathered pieces on the way. Measured on CPU (megatron-core 0.16.1, 135M
# and 168M parameters, bf16, bench/save_memory.py): 36.0 B per parameter above the process's resident size,
# with megatron's writer and with the project's streaming one alike. The "dp_reshardable" form saves the
# optimizer's own tensors: 0.6-1.9 B, and the streaming writer (checkpoint/stream_save.py) copies one tensor per
# writer thread to the host at a time (STREAM_SAVE_THREADS of the largest, an fp32 embedding shard).
RESHARDABLE_SAVE_BYTES = 36
STREAM_SAVE_THREADS = 2
ADAM_BYTES = 8  # exp_avg + exp_avg_sq in fp32
CPU_COPY_BYTES = 4  # megatron's CPU optimizer per offloaded parameter: an fp32 copy and an fp32 gradient, each
# pinned per tensor (the gradient unless pin_cpu_grads=false), besides Adam's two moments in pageable memory
MASTER_BYTES = 4  # fp32 master weights, when training in 16-bit
LOGIT_BYTES = 6  # per vocab entry and token: 16-bit logits and, in backward, their gradient twice (actor/logprobs.py)
PLAIN_CE_LOGIT_BYTES = 10  # a plain cross-entropy's: 16-bit logits, their fp32 copy for the loss, its fp32 gradient
KV_BYTES = 2
ADAM_CHECKPOINT_BYTES = 12  # per parameter in a checkpoint: fp32 master copy and both Adam moments, any format
MEGATRON, ROLLOUT = "actor_rollout_ref.actor.megatron", "actor_rollout_ref.rollout"  # sections of the defaults


@dataclass(frozen=True)
@defaults_from(MEGATRON)
class MemoryOptions:
    """The memory-relevant settings (``budget.memory_options`` reads them from a config). A field named like a
    setting of MEGATRON defaults to the schema's, and so does one renamed from a setting; the others are the
    memory model's own."""

    dtype: str = SETTING
    use_distributed_optimizer: bool = SETTING
    param_offload: bool = SETTING
    grad_offload: bool = SETTING
    optimizer_offload: float = 0.0  # share of the Adam states in host memory (True: all)
    optimizer_stays: bool = False  # the optimizer's GPU side stays there between updates
    pinned_cpu_grads: bool = True  # megatron's pin_cpu_grads: the CPU optimizer's gradients in pinned memory
    precision_aware_optimizer: bool = False  # TE's: with CPU offload, the fp32 masters live on the host too
    # checkpoints hold the optimizer state gathered into a TP/PP-free form
    reshardable_checkpoint: bool = schema_default(f"{MEGATRON}.dist_ckpt_optim_fully_reshardable")
    sequence_parallel: bool = SETTING
    recompute: bool = schema_default("actor_rollout_ref.model.enable_gradient_checkpointing")
    attention: str = "sdpa"  # "sdpa" (flash/memory-efficient) or "unfused" (materialised scores)
    # > 0: LoRA adapters train, the base is frozen and is also the reference (no ref weights)
    lora_rank: int = schema_default("actor_rollout_ref.model.lora.rank")


@dataclass
class MemoryEstimate:
    """GiB per GPU, on the most loaded pipeline stage."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    reference: float
    rollout: float
    kv_cache: float
    kv_sequences: float
    phases: dict[str, float] = field(default_factory=dict)
    offloaded: list[str] = field(default_factory=list)
    host: float = 0.0  # GiB of host memory per GPU: offloaded state and the hybrid optimizer's host side
    # ... while a checkpoint is saved: a reshardable optimizer state is first gathered on the host
    # (RESHARDABLE_SAVE_BYTES per parameter); each rank's own shards stream through it a tensor at a time
    host_at_save: float = 0.0

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


def params_per_gpu(shape: ModelShape, layout: ParallelLayout) -> tuple[float, float]:
    """(dense, expert) parameters held by one GPU of the heaviest pipeline stage.

    Dense weights divide by TP even when TP exceeds the KV heads: megatron splits the fused QKV
    rows evenly (``(heads + 2 * kv) * head_dim / TP`` per rank) and gathers the output, storing no replica.
    """
    layers = shape.num_layers / layout.pp
    per_layer_dense = shape.dense_params - shape.embedding_params - shape.hidden_size
    per_layer_dense /= shape.num_layers
    # The first stage holds the embedding, the last the output layer (a copy of it when tied).
    vocab_matrices = 1 if layout.pp > 1 or shape.tie_embeddings else 2
    dense = layers * per_layer_dense + vocab_matrices * shape.vocab_size * shape.hidden_size
    expert = layers * shape.expert_params_per_layer
    return dense / layout.tp, expert / (layout.ep * layout.etp)


def param_tensor_sizes(shape: ModelShape, layout: ParallelLayout) -> list[float]:
    """Elements of each parameter tensor one GPU of the heaviest pipeline stage holds."""
    h, tp = shape.hidden_size, layout.tp
    q, kv = shape.num_attention_heads * shape.head_dim, 2 * shape.num_kv_heads * shape.head_dim
    layer = [h * (q + kv) / tp, q * h / tp, h, h] + ([(q + kv) / tp] if shape.qkv_bias else [])
    if shape.is_moe:
        f, experts = shape.moe_ffn_hidden_size / layout.etp, shape.num_experts // layout.ep
        layer += [2 * f * h, f * h] * experts + [shape.num_experts * h]
    else:
        layer += [2 * shape.ffn_hidden_size * h / tp, shape.ffn_hidden_size * h / tp]
    vocab_matrices = 1 if layout.pp > 1 or shape.tie_embeddings else 2
    return [shape.vocab_size * h / tp] * vocab_matrices + layer * round(shape.num_layers / layout.pp) + [h]


def pinned_rounding(shape: ModelShape, layout: ParallelLayout, shards: int = 1, element_bytes: int = 4) -> float:
    """Host bytes over tensor bytes when each parameter tensor (split into ``shards``) is copied to pinned memory
    on its own: torch's pinned allocator rounds every request up to a power of two."""
    sizes = [max(1.0, n * element_bytes / shards) for n in param_tensor_sizes(shape, layout)]
    return sum(2 ** math.ceil(math.log2(b)) for b in sizes) / sum(sizes)


def activation_bytes_per_token_layer(
    shape: ModelShape, layout: ParallelLayout, seq_len: int, opts: MemoryOptions
) -> float:
    h = shape.hidden_size
    f = shape.experts_per_token * shape.moe_ffn_hidden_size if shape.is_moe else shape.ffn_hidden_size
    # key/value width on one rank: kv/TP heads, or one whole head when TP exceeds the KV heads
    kv_per_rank = kv_heads_per_rank(shape.num_kv_heads, layout.tp) * shape.head_dim
    replicated = 2 * 4 * h  # norm inputs/outputs: split only by sequence parallelism
    # attention: QKV input, q, output, o-proj input (4h); MLP: SwiGLU's 2f input and fc2's f input (3f). Measured
    # (Qwen2.5-1.5B, one H200, update budgets of 8,192 / 16,384 / 24,576 tokens): 2.62 MiB a token with the
    # logits, where this gives 3.02 and the former 5f gave 3.88 (peaks 53.5 / 75.0 / 96.5 GiB, estimated now
    # 55.8 / 80.0 / 104.2, before 63.4 / 95.2 / 127.0).
    split = 2 * (4 * h + 3 * f)
    if opts.attention == "unfused":
        split += 6 * shape.num_attention_heads * seq_len / layout.cp
    sp = layout.tp if opts.sequence_parallel and layout.tp > 1 else 1
    return replicated / sp + split / layout.tp + 2 * 4 * kv_per_rank


def activation_gib(
    shape: ModelShape, layout: ParallelLayout, micro_batch: int, seq_len: int, opts: MemoryOptions
) -> float:
    """Saved activations of one pipeline stage; 1F1B keeps up to PP micro-batches in flight."""
    tokens = micro_batch * seq_len / layout.cp
    per_layer = activation_bytes_per_token_layer(shape, layout, seq_len, opts) * tokens
    layers = shape.num_layers / layout.pp
    in_flight = layout.pp
    if opts.recompute:  # keep only each layer's input, rebuild one layer at a time
        sp = layout.tp if opts.sequence_parallel and layout.tp > 1 else 1
        inputs = 2 * shape.hidden_size * tokens / sp
        return (layers * inputs * in_flight + per_layer) / GiB
    return layers * per_layer * in_flight / GiB


def logits_gib(shape: ModelShape, layout: ParallelLayout, micro_batch: int, seq_len: int) -> float:
    """Vocab-parallel logits of one micro-batch and what the log-softmax keeps for backward."""
    tokens = micro_batch * seq_len / layout.cp
    return tokens * shape.vocab_size / layout.tp * LOGIT_BYTES / GiB


def lora_params_per_gpu(shape: ModelShape, layout: ParallelLayout, rank: int) -> float:
    """LoRA parameters on one GPU of the heaviest stage, adapters on the four dense linears of every layer:
    a column-parallel linear's A [r, in] whole and B [out/TP, r], a row-parallel one's A [r, in/TP] and B whole.
    (Adapters on MoE experts are not counted.)"""
    h, tp = shape.hidden_size, layout.tp
    qkv = (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim
    attn = shape.num_attention_heads * shape.head_dim
    ffn = 0 if shape.is_moe else shape.ffn_hidden_size
    per_layer = rank * (h + qkv / tp) + rank * (attn / tp + h)
    if ffn:
        per_layer += rank * (h + 2 * ffn / tp) + rank * (ffn / tp + h)
    return shape.num_layers / layout.pp * per_layer


def trained_params_per_gpu(shape: ModelShape, layout: ParallelLayout, lora_rank: int) -> float:
    """Parameters the optimizer holds on one GPU of the heaviest stage, what a checkpoint's optimizer state and its
    save cover: with LoRA the adapters alone (the frozen base has no optimizer state), else every parameter."""
    return lora_params_per_gpu(shape, layout, lora_rank) if lora_rank else sum(params_per_gpu(shape, layout))


def training_state_gib(shape: ModelShape, layout: ParallelLayout, opts: MemoryOptions, shard_optimizer: bool = True):
    """(weights, gradients, optimizer) in GiB on one GPU during the update. With LoRA only the adapters have
    gradients, fp32 masters and Adam states; the frozen base has none of them."""
    dense, expert = params_per_gpu(shape, layout)
    params = dense + expert
    wbytes = DTYPE_BYTES[opts.dtype]
    masters_here = wbytes < 4 and not (opts.optimizer_offload and opts.precision_aware_optimizer)
    opt_bytes = ADAM_BYTES * (1 - float(opts.optimizer_offload)) + (MASTER_BYTES if masters_here else 0)
    dense_shards = layout.dp if (opts.use_distributed_optimizer and shard_optimizer) else 1
    expert_shards = layout.expert_dp if (opts.use_distributed_optimizer and shard_optimizer) else 1
    if opts.lora_rank > 0:
        adapters = lora_params_per_gpu(shape, layout, opts.lora_rank)
        optimizer = opt_bytes * adapters / dense_shards
        return (params + adapters) * wbytes / GiB, adapters * GRAD_BYTES / GiB, optimizer / GiB
    optimizer = opt_bytes * (dense / dense_shards + expert / expert_shards)
    return params * wbytes / GiB, params * GRAD_BYTES / GiB, optimizer / GiB


def rollout_params_per_gpu(shape: ModelShape, rollout_tp: int) -> float:
    """Parameters one rollout-TP rank holds: a 1/TP share, plus the replicas of the K/V projections
    (weights and biases) when TP exceeds the KV heads and each rank keeps a whole head (vLLM)."""
    replicas = kv_heads_per_rank(shape.num_kv_heads, rollout_tp) * rollout_tp - shape.num_kv_heads
    kv_head_params = 2 * shape.head_dim * (shape.hidden_size + (1 if shape.qkv_bias else 0))
    return (shape.num_params + shape.num_layers * replicas * kv_head_params) / rollout_tp


def rollout_gib(
    shape: ModelShape,
    rollout_tp: int,
    dtype: str,
    seq_len: int,
    gpu_gib: float,
    utilization: float,
    static_sequences: int | None = None,
):
    """(weights, KV-cache budget, full-length sequences that fit) of the rollout engine on one GPU.

    vLLM takes ``utilization`` of the GPU and fills what its weights leave with KV cache; an engine with a
    static cache (``static_sequences``: rollout.max_num_seqs) holds exactly that many full-length sequences.
    """
    weights = rollout_params_per_gpu(shape, rollout_tp) * DTYPE_BYTES[dtype] / GiB
    kv_heads = kv_heads_per_rank(shape.num_kv_heads, rollout_tp)
    kv_per_token = 2 * shape.num_layers * kv_heads * shape.head_dim * KV_BYTES
    if static_sequences is not None:
        return weights, static_sequences * seq_len * kv_per_token / GiB, float(static_sequences)
    budget = max(gpu_gib * utilization - weights, 0.0)
    return weights, budget, budget * GiB / (kv_per_token * seq_len)


def host_gib(shape: ModelShape, layout: ParallelLayout, opts: MemoryOptions, offloaded: float) -> tuple[float, float]:
    """(host memory per GPU, the same while a checkpoint is saved) in GiB: the ``offloaded`` GiB of GPU state that
    waits on the host between phases, plus the hybrid optimizer's host side (pinned copies rounded up, Adam's
    moments); a save adds the optimizer state gathered into a reshardable form, or the tensors streamed to the files."""
    shards = layout.dp if opts.use_distributed_optimizer else 1
    pinned = CPU_COPY_BYTES * (2 if opts.pinned_cpu_grads else 1)
    per_param = pinned * pinned_rounding(shape, layout, shards) + 2 * CPU_COPY_BYTES - pinned + ADAM_BYTES
    trained = trained_params_per_gpu(shape, layout, opts.lora_rank)
    hybrid = float(opts.optimizer_offload) * per_param * trained / shards / GiB
    host = offloaded + hybrid
    gathered = RESHARDABLE_SAVE_BYTES * trained / GiB
    streamed = STREAM_SAVE_THREADS * 4 * shape.vocab_size * shape.hidden_size / layout.tp / GiB
    return host, host + (gathered if opts.reshardable_checkpoint else streamed)


@defaults_from(ROLLOUT)
def estimate_grpo_memory(
    shape: ModelShape,
    layout: ParallelLayout,
    opts: MemoryOptions,
    micro_batch: int,
    seq_len: int,
    gpu_gib: float,
    with_reference: bool = True,
    ref_offload: bool = schema_default("actor_rollout_ref.ref.megatron.param_offload"),
    rollout_tp: int = schema_default(f"{ROLLOUT}.tensor_model_parallel_size"),
    rollout_utilization: float = schema_default(f"{ROLLOUT}.gpu_memory_utilization"),
    rollout_dtype: str = schema_default(f"{ROLLOUT}.dtype"),
    free_cache_engine: bool = SETTING,
    log_prob_micro_batch: int | None = None,
    static_sequences: int | None = None,
) -> MemoryEstimate:
    weights, grads, optimizer = training_state_gib(shape, layout, opts)
    acts = activation_gib(shape, layout, micro_batch, seq_len, opts)
    logits = logits_gib(shape, layout, micro_batch, seq_len)
    with_reference = with_reference and opts.lora_rank == 0  # LoRA: the reference is the actor's base, adapters off
    reference = weights if with_reference else 0.0
    r_weights, kv, kv_seqs = rollout_gib(
        shape, rollout_tp, rollout_dtype, seq_len, gpu_gib, rollout_utilization, static_sequences
    )
    rollout = r_weights + kv if static_sequences is not None else gpu_gib * rollout_utilization

    moved = bool(opts.optimizer_offload) and not opts.optimizer_stays  # its GPU side waits in host memory
    offloaded = [
        name
        for name, on in [("parameters", opts.param_offload), ("gradients", opts.grad_offload), ("optimizer", moved)]
        if on
    ]
    if with_reference and ref_offload:
        offloaded.append("reference")
    between = 0 if moved else optimizer
    resident = (0 if opts.param_offload else weights) + (0 if opts.grad_offload else grads) + between
    ref_resident = 0 if ref_offload else reference
    waiting = (  # on the host between phases
        (weights if opts.param_offload else 0)
        + (grads if opts.grad_offload else 0)
        + (optimizer if moved else 0)
        + (reference if with_reference and ref_offload else 0)
    )
    host, host_at_save = host_gib(shape, layout, opts, waiting)
    # asleep, vLLM frees everything; the static engine keeps its weights and frees the cache
    asleep = (r_weights if static_sequences is not None else 0) if free_cache_engine else rollout
    lp_mb = log_prob_micro_batch or micro_batch
    # Forward only: one layer's activations at a time, plus the micro-batch's logits.
    lp_acts = activation_bytes_per_token_layer(shape, layout, seq_len, opts) * lp_mb * seq_len / layout.cp / GiB
    lp_logits = logits_gib(shape, layout, lp_mb, seq_len)
    phases = {
        "generation": resident + ref_resident + rollout,
        "log_prob": (
            weights + (0 if opts.grad_offload else grads) + between + ref_resident + asleep + lp_acts + lp_logits
        ),
        "update": weights + grads + optimizer + ref_resident + asleep + acts + logits,
    }
    if with_reference and ref_offload:
        phases["log_prob"] = max(phases["log_prob"], phases["log_prob"] + reference)
    return MemoryEstimate(
        weights=weights,
        gradients=grads,
        optimizer=optimizer,
        activations=acts,
        logits=logits,
        reference=reference,
        rollout=r_weights,
        kv_cache=kv,
        kv_sequences=kv_seqs,
        phases=phases,
        offloaded=offloaded,
        host=host,
        host_at_save=host_at_save,
    )


def forward_backward_peak_gib(
    shape: ModelShape, layout: ParallelLayout, batch: int, seq_len: int, attention: str
) -> float:
    """Peak of a plain 16-bit forward + backward with gradients in 16-bit and no optimizer: what the
    throughput baselines measured, used to check the activation model."""
    opts = MemoryOptions(sequence_parallel=False, attention=attention)
    dense, expert = params_per_gpu(shape, layout)
    state = (dense + expert) * (2 + 2) / GiB
    plain_ce = logits_gib(shape, layout, batch, seq_len) * PLAIN_CE_LOGIT_BYTES / LOGIT_BYTES
    return state + activation_gib(shape, layout, batch, seq_len, opts) + plain_ce


def checkpoint_gb(shape: ModelShape, dtype: str, lora_rank: int, contents: Collection[str]) -> tuple[float, float]:
    """(one checkpoint, its weights alone) in GB (1e9 bytes, as disks count) for actor.checkpoint.save_contents
    ``contents``: the trained weights (a LoRA run's adapters; its frozen base stays model.path's), the weights again
    as Hugging Face files with ``hf_model``, and Adam's state with ``optimizer``."""
    saved = trained_params_per_gpu(shape, ParallelLayout(world_size=1), lora_rank)
    one = weights = saved * DTYPE_BYTES[dtype] / 1e9
    if "hf_model" in contents:
        one += weights
    if "optimizer" in contents:
        one += saved * ADAM_CHECKPOINT_BYTES / 1e9
    return one, weights
