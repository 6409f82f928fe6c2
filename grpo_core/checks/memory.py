"""Checks of what a run needs room for: GPU memory by phase, host memory for offloaded state and checkpoint saves,
and disk for its checkpoints; with the settings to change where it does not fit."""

import shutil
from pathlib import Path

from grpo_core.checks.report import Report
from grpo_core.config.schema import GRPOConfig
from grpo_core.models.shape import ModelShape
from grpo_core.planning.batches import batch_settings
from grpo_core.planning.budget import (
    estimate_memory,
    fitting_batches,
    gpu_memory_gib,
    local_host_memory_gib,
    memory_options,
)
from grpo_core.planning.layout import ParallelLayout
from grpo_core.planning.memory import checkpoint_gb
from grpo_core.planning.planner import PEAK_SHARE


def _batch_remedy(cfg: GRPOConfig, shape: ModelShape, phase: str) -> str:
    """The values that fit, where smaller micro-batches are enough; else the settings to lower (the generation
    phase has none: its share is rollout.gpu_memory_utilization)."""
    if fits := fitting_batches(cfg, shape):
        return "set " + " ".join(f"{key}={value}" for key, value in fits.items()) + " (estimated to fit), "
    now = ", ".join(f"{s.key} (now {s.value})" for s in batch_settings(cfg, phase))
    return f"lower {now}, " if now else ""


def check_memory(cfg: GRPOConfig, shape: ModelShape, layout: ParallelLayout, r: Report) -> None:
    rollout, gpu = cfg.actor_rollout_ref.rollout, gpu_memory_gib(cfg)
    limit = f"trainer.gpu_memory_gib={gpu:g}"
    if gpu < cfg.trainer.gpu_memory_gib:
        limit = f"this machine's GPU memory, {gpu:.1f} GiB"
        r.warnings.append(
            f"trainer.gpu_memory_gib={cfg.trainer.gpu_memory_gib:g}, but this machine's GPUs have {gpu:.1f} GiB: "
            "memory is checked against those"
        )
    if not 0 < rollout.gpu_memory_utilization <= 1:
        r.errors.append(f"rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1]")
        return
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    opts = memory_options(cfg)
    r.memory = est = estimate_memory(cfg, shape)
    if cfg.trainer.device != "cuda":
        return
    if est.kv_sequences < 1:
        r.errors.append(
            f"the rollout's KV cache cannot hold one {seq_len}-token sequence: its weights take "
            f"{est.rollout:.1f} GiB of the {gpu * rollout.gpu_memory_utilization:.1f} GiB it may use; raise "
            "rollout.gpu_memory_utilization or rollout.tensor_model_parallel_size"
        )
    if est.peak > gpu:
        r.errors.append(
            f"estimated peak {est.peak:.1f} GiB per GPU ({est.peak_phase} phase) exceeds {limit}; "
            f"in the guide's order: {_batch_remedy(cfg, shape, est.peak_phase)}"
            "turn on param_offload/grad_offload/optimizer_offload "
            f"(now {opts.param_offload}/{opts.grad_offload}/{opts.optimizer_offload:g}), train in bf16 "
            f"(now {opts.dtype}), raise TP/PP (now {layout.tp}/{layout.pp}), "
            f"or lower rollout.gpu_memory_utilization (now {rollout.gpu_memory_utilization}); "
            "`grpo plan` suggests a layout"
        )
    elif est.peak > PEAK_SHARE * gpu:
        r.warnings.append(f"estimated peak {est.peak:.1f} GiB is within 10% of the GPU's {gpu:.1f} GiB")
    per_node, node = cfg.trainer.n_gpus_per_node, cfg.trainer.host_memory_gib or local_host_memory_gib()
    host, at_save = est.host * per_node, est.host_at_save * per_node
    if node and host <= 0.9 * node < at_save:
        how = (
            "gathers the optimizer state into a layout-independent form (36 bytes per parameter; "
            "actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=false saves each rank's shards "
            "instead, resumable at the same TP/PP)"
            if opts.reshardable_checkpoint
            else "streams each rank's tensors through host memory, two at a time"
        )
        r.errors.append(
            f"a checkpoint save would need an estimated {at_save:.0f} GiB of host memory per node, over 90% of the "
            f"node's {node:.0f} GiB: the checkpoint save {how}, beside the {host:.0f} GiB of offloaded "
            "state, and the kernel kills the run; use more GPUs, a node with more host memory, or less offload "
            "(ref.megatron.param_offload, optimizer_offload_fraction)"
        )
    if node and host > 0.9 * node:
        r.errors.append(
            f"estimated {host:.0f} GiB of host memory per node for offloaded state exceeds 90% of the node's "
            f"{node:.0f} GiB (megatron's CPU optimizer alone takes 16 bytes per offloaded parameter, more where its "
            "pinned tensors round up to powers of two); lower "
            "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction, keep its "
            "gradients in pageable memory (override_optimizer_config.pin_cpu_grads=false: slower copies), keep the "
            "reference on the GPU (ref.megatron.param_offload=false), or use more GPUs"
        )


def _free_gb(directory: str) -> float | None:
    """Free space where ``directory`` is or will be created (its nearest existing parent)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free / 1e9
    except OSError:
        return None


def check_checkpoint_disk(cfg: GRPOConfig, shape: ModelShape, r: Report) -> None:
    """A save that cannot fit fails at the end of a run (its partial directory removed): say so before the start.
    Only where the run would write (a GPU run's dry run on a laptop says nothing about the cluster's disks)."""
    import torch

    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        return
    where = cfg.trainer.default_local_dir or "."
    if (free := _free_gb(where)) is None:
        return
    actor, keep = cfg.actor_rollout_ref.actor, cfg.trainer.max_actor_ckpt_to_keep
    lora_rank, contents = cfg.actor_rollout_ref.model.lora.rank, actor.checkpoint.save_contents
    one, weights = checkpoint_gb(shape, actor.megatron.dtype, lora_rank, contents)
    lean = ""
    if "optimizer" in contents:
        lean = (
            "; actor_rollout_ref.actor.checkpoint.save_contents=[model,extra] leaves Adam's state out "
            f"({weights:.1f} GB a checkpoint; a resume then starts Adam afresh)"
        )
    if one > free:
        r.errors.append(
            f"a checkpoint of this run takes ~{one:.1f} GB, more than the {free:.1f} GB free for "
            f"trainer.default_local_dir={where}: its first save would fail; free space or point it elsewhere{lean}"
        )
    elif keep is not None and (keep + 1) * one > free:
        r.warnings.append(
            f"{keep + 1} checkpoints of ~{one:.1f} GB (trainer.max_actor_ckpt_to_keep={keep}, and the one being "
            f"saved) exceed the {free:.1f} GB free for trainer.default_local_dir={where}{lean}"
        )
