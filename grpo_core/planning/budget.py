"""The memory model (memory.py) applied to a config: its memory options, the GPU it is checked against, the
estimate by phase, and the largest micro-batch settings that fit (what a memory error names as its remedy).
"""

import copy
import math
import os

from grpo_core.config import hardware
from grpo_core.config.schema import GRPOConfig
from grpo_core.models.shape import ModelShape
from grpo_core.planning.batches import batch_settings, log_prob_micro_batch, update_micro_batch
from grpo_core.planning.layout import actor_layout
from grpo_core.planning.memory import MemoryEstimate, MemoryOptions, estimate_grpo_memory
from grpo_core.planning.planner import PEAK_SHARE


def local_host_memory_gib() -> float | None:
    """This machine's memory, when it is a GPU node (a dry run on a laptop says nothing about the cluster)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def gpu_memory_gib(cfg: GRPOConfig) -> float:
    """trainer.gpu_memory_gib, or this machine's GPUs where they are clearly smaller (a config written for a larger
    card); within 5% the setting stands, as a nominal size does (an "80 GB" H100 has 79.6 GiB)."""
    configured = cfg.trainer.gpu_memory_gib
    local = hardware.local_gpu_memory_gib() if cfg.trainer.device == "cuda" else None
    return local if local is not None and local < 0.95 * configured else configured


def optimizer_offloaded(cfg: GRPOConfig) -> float:
    """The share of the Adam states megatron's hybrid optimizer keeps on the host: ``optimizer_offload`` (all),
    unless override_optimizer_config (applied after it, as in the actor) says otherwise."""
    m, overrides = cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.actor.optim.override_optimizer_config
    on = overrides.get("optimizer_cpu_offload", m.optimizer_offload)
    fraction = overrides.get("optimizer_offload_fraction", 1.0 if m.optimizer_offload else 0.0)
    return min(max(float(fraction), 0.0), 1.0) if on and isinstance(fraction, int | float) else 0.0


def memory_options(cfg: GRPOConfig) -> MemoryOptions:
    m = cfg.actor_rollout_ref.actor.megatron
    return MemoryOptions(
        dtype=m.dtype,
        use_distributed_optimizer=m.use_distributed_optimizer,
        param_offload=m.param_offload,
        grad_offload=m.grad_offload,
        optimizer_offload=optimizer_offloaded(cfg),
        optimizer_stays=not m.optimizer_offload,
        pinned_cpu_grads=bool(cfg.actor_rollout_ref.actor.optim.override_optimizer_config.get("pin_cpu_grads", True)),
        reshardable_checkpoint=m.dist_ckpt_optim_fully_reshardable
        and "optimizer" in cfg.actor_rollout_ref.actor.checkpoint.save_contents,
        precision_aware_optimizer=bool(
            cfg.actor_rollout_ref.actor.optim.override_optimizer_config.get("use_precision_aware_optimizer")
        ),
        sequence_parallel=m.sequence_parallel,
        recompute=cfg.actor_rollout_ref.model.enable_gradient_checkpointing
        or m.override_transformer_config.get("recompute_granularity") is not None,
        lora_rank=cfg.actor_rollout_ref.model.lora.rank,
    )


def estimate_memory(cfg: GRPOConfig, shape: ModelShape) -> MemoryEstimate:
    """Per-GPU GiB by phase for this config: what the dry run checks and an out-of-memory error quotes."""
    arr = cfg.actor_rollout_ref
    rollout, actor = arr.rollout, arr.actor
    return estimate_grpo_memory(
        shape,
        actor_layout(cfg),
        memory_options(cfg),
        update_micro_batch(cfg),
        cfg.data.max_prompt_length + cfg.data.max_response_length,
        gpu_memory_gib(cfg),
        with_reference=actor.use_kl_loss or cfg.algorithm.use_kl_in_reward,
        ref_offload=arr.ref.megatron.param_offload,
        rollout_tp=rollout.tensor_model_parallel_size,
        rollout_utilization=rollout.gpu_memory_utilization,
        rollout_dtype=rollout.dtype,
        free_cache_engine=rollout.free_cache_engine,
        log_prob_micro_batch=log_prob_micro_batch(cfg),
        static_sequences=rollout.max_num_seqs if rollout.name == "static" else None,
    )


def fitting_batches(cfg: GRPOConfig, shape: ModelShape) -> dict[str, int]:
    """The largest micro-batch settings for which the estimated peak stays under 90% of the GPU (the planner's
    margin), lowered a sequence at a time in the phase that is over: {key: value} of those changed, token budgets in
    whole sequences. Empty where one sequence per micro-batch is not enough (then it takes offload or the layout)."""
    gpu, trial, changed = gpu_memory_gib(cfg), copy.deepcopy(cfg), {}
    while (est := estimate_memory(trial, shape)).peak > PEAK_SHARE * gpu:
        settings = batch_settings(trial, est.peak_phase)
        sequences = max((s.value / s.smallest for s in settings), default=1)  # what the largest micro-batch holds
        if sequences <= 1:
            return {}
        fewer = math.ceil(sequences) - 1
        for s in settings:
            if s.value > s.holding(fewer):
                setattr(s.section, s.attr, s.holding(fewer))
                changed[s.key] = s.holding(fewer)
    return changed
