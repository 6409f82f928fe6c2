"""Recommend a layout, offload and micro-batch for a model on N GPUs, from the memory model.

The rules, in the order they are applied (each is said back to the user with the numbers):
1. Offload costs host-device copies every step, so it is used only when nothing fits without it:
   first none, then parameters + gradients (frees the generation phase), then also the optimizer
   (Adam steps on the host; frees the update phase).
2. The smallest model-parallel group (TP x PP) whose full training state fits in half a GPU at
   DP=1. The other half is for activations, the reference model and the rollout's KV cache, and the
   layout does not depend on the distributed optimizer's sharding to fit.
3. TP stays inside a node and is balanced against PP (TP's all-reduces grow with TP, PP adds
   pipeline bubbles); on a tie the larger TP wins. MoE experts are spread over EP inside a node.
4. The largest micro-batch whose update phase stays under 90 % of the GPU.
"""

from dataclasses import dataclass, field

from grpo_core.config.defaults import SETTING, defaults_from
from grpo_core.models.shape import ModelShape
from grpo_core.planning.layout import ParallelLayout, tp_splits_kv_heads
from grpo_core.planning.memory import MemoryEstimate, MemoryOptions, estimate_grpo_memory, training_state_gib

STATIC_SHARE = 0.5
PEAK_SHARE = 0.9
MAX_ROLLOUT_SHARE = 0.8
MICRO_BATCHES = (16, 8, 4, 2, 1)
MIN_KV_SEQUENCES = 8  # full-length sequences the rollout's KV cache must hold at once
OFFLOAD_LEVELS = (
    ("none", {}),
    ("parameters + gradients", {"param_offload": True, "grad_offload": True}),
    (
        "parameters + gradients + optimizer",
        {"param_offload": True, "grad_offload": True, "optimizer_offload": True},
    ),
)


@dataclass
class Plan:
    layout: ParallelLayout
    options: MemoryOptions
    micro_batch: int
    rollout_tp: int
    rollout_utilization: float
    estimate: MemoryEstimate
    uneven_stages: tuple[int | None, int | None] = (None, None)
    reasons: list[str] = field(default_factory=list)


def rollout_tp_fits(shape: ModelShape, tp: int) -> bool:
    """vLLM splits the heads over TP and replicates KV heads when TP exceeds them."""
    return shape.num_attention_heads % tp == 0 and tp_splits_kv_heads(shape.num_kv_heads, tp)


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _splits(model_parallel: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(TP, PP) pairs for a model-parallel size, most balanced first, larger TP on ties."""
    pairs = [(tp, model_parallel // tp) for tp in _powers_of_two(min(model_parallel, gpus_per_node))]
    pairs = [(tp, pp) for tp, pp in pairs if tp * pp == model_parallel]
    return sorted(pairs, key=lambda p: (abs(p[0].bit_length() - p[1].bit_length()), -p[0]))


def uneven_stages(num_layers: int, pp: int) -> tuple[int | None, int | None]:
    """First/last stage sizes that make the middle stages even, when the layers do not divide by PP.
    The outer stages get fewer layers: they also carry the embedding and the output layer."""
    if pp <= 2 or num_layers % pp == 0:
        return None, None
    for outer in range(num_layers // pp, 0, -1):
        if (num_layers - 2 * outer) % (pp - 2) == 0:
            return outer, outer
    return None, None


def _expert_parallel(shape: ModelShape, gpus: int, pp: int, gpus_per_node: int) -> int:
    if not shape.is_moe:
        return 1
    for ep in reversed(_powers_of_two(min(gpus_per_node, gpus // pp))):
        if shape.num_experts % ep == 0:
            return ep
    return 1


@defaults_from("actor_rollout_ref.actor.megatron")
def plan_layout(
    shape: ModelShape,
    gpus: int,
    gpu_gib: float,
    seq_len: int = 2048,
    gpus_per_node: int = 8,
    dtype: str = SETTING,
    lora_rank: int = 0,
) -> Plan | None:
    """The first layout the rules above accept, or None when the model does not fit on these GPUs. ``lora_rank``:
    LoRA adapters of that rank train on the frozen base, which is also the reference (no gradients, optimizer state
    or reference weights for the base)."""
    for offload_name, offload in OFFLOAD_LEVELS:
        opts = MemoryOptions(dtype=dtype, lora_rank=lora_rank, **offload)
        for model_parallel in _powers_of_two(gpus):
            for tp, pp in _splits(model_parallel, gpus_per_node):
                ep = _expert_parallel(shape, gpus, pp, gpus_per_node)
                layout = ParallelLayout(world_size=gpus, tp=tp, pp=pp, ep=ep)
                stages = uneven_stages(shape.num_layers, pp)
                if layout.problems(shape, stages):
                    continue
                state = sum(training_state_gib(shape, layout, opts, shard_optimizer=False))
                if state > STATIC_SHARE * gpu_gib:
                    continue
                plan = _fit_micro_batch(shape, layout, opts, seq_len, gpu_gib, gpus_per_node)
                if plan is None:
                    continue
                plan.uneven_stages = stages
                plan.reasons = [
                    f"offload: {offload_name} (the first level at which a layout fits)",
                    f"TP={tp} x PP={pp}: the smallest model-parallel group whose training state at DP=1 "
                    f"({state:.1f} GiB) fits in {STATIC_SHARE:.0%} of {gpu_gib:g} GiB",
                    f"DP={layout.dp}: the remaining factor of {gpus} GPUs",
                ]
                if stages[0]:
                    plan.reasons.append(
                        f"uneven pipeline: {stages[0]} layers in the first and last stages, so the "
                        f"{shape.num_layers} layers fill PP={pp} stages"
                    )
                if ep > 1:
                    plan.reasons.append(f"EP={ep}: {shape.num_experts} experts spread inside a node")
                plan.reasons.append(
                    f"micro-batch {plan.micro_batch} x {seq_len} tokens: the largest whose update phase "
                    f"({plan.estimate.phases['update']:.1f} GiB) stays under {PEAK_SHARE:.0%} of the GPU"
                )
                plan.reasons.append(
                    f"rollout TP={plan.rollout_tp}, gpu_memory_utilization {plan.rollout_utilization:.2f}: "
                    f"the smallest TP whose KV cache holds {MIN_KV_SEQUENCES}+ full sequences "
                    f"({plan.estimate.kv_sequences:.0f}) next to the resident training state"
                )
                return plan
    return None


def _fit_micro_batch(shape, layout, opts, seq_len, gpu_gib, gpus_per_node) -> Plan | None:
    for micro_batch in MICRO_BATCHES:
        est = estimate_grpo_memory(shape, layout, opts, micro_batch, seq_len, gpu_gib, rollout_utilization=0.0)
        if est.phases["update"] > PEAK_SHARE * gpu_gib:
            continue
        # The rollout engine gets what the resident training state leaves, in steps of 5 %.
        resident = est.phases["generation"]
        util = min(MAX_ROLLOUT_SHARE, int((PEAK_SHARE * gpu_gib - resident) / gpu_gib * 20) / 20)
        if util < 0.1:
            return None
        for rollout_tp in _powers_of_two(min(gpus_per_node, layout.world_size)):
            if not rollout_tp_fits(shape, rollout_tp):
                continue
            est = estimate_grpo_memory(
                shape,
                layout,
                opts,
                micro_batch,
                seq_len,
                gpu_gib,
                rollout_tp=rollout_tp,
                rollout_utilization=util,
            )
            if est.kv_sequences >= MIN_KV_SEQUENCES:
                return Plan(layout, opts, micro_batch, rollout_tp, util, est)
        return None
    return None
