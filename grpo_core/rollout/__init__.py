"""Rollout engines: sample responses for prompts. ``build_engine`` picks one from the config."""

import os

import torch

from grpo_core.models.shape import hf_overrides
from grpo_core.rollout.base import Generation, RolloutEngine, SamplingSettings, draw, to_rollout_batch


def build_engine(cfg, shape, model_dir: str, tokenizer, actor=None) -> RolloutEngine:
    """This rank's engine for ``actor_rollout_ref.rollout.name``, loaded from ``model_dir`` (megatron: on
    ``actor``'s own model, every rank of it)."""
    r = cfg.actor_rollout_ref.rollout
    trust = cfg.actor_rollout_ref.model.trust_remote_code
    config_overrides = hf_overrides(cfg.actor_rollout_ref.model.override_config)
    if r.name == "hf":
        from grpo_core.rollout.hf import HFEngine

        where = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return HFEngine(
            model_dir,
            tokenizer,
            dtype=r.dtype,
            device=where,
            max_batch_size=r.max_num_seqs,
            trust_remote_code=trust,
            config_overrides=config_overrides,
        )
    if r.name == "vllm":
        from grpo_core.rollout.hf import DTYPES
        from grpo_core.rollout.vllm import VLLMEngine

        max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
        placement: dict = {}
        if torch.cuda.is_available():  # this rank's GPU and those of its rollout-TP peers
            first = int(os.environ.get("LOCAL_RANK", "0"))
            placement["device_ids"] = list(range(first, first + r.tensor_model_parallel_size))
        else:  # on a CPU, gpu_memory_utilization would be a share of host RAM: size the KV cache instead
            kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPES[r.dtype].itemsize
            placement["kv_cache_memory_bytes"] = kv_per_token * max_model_len * r.max_num_seqs + (64 << 20)
        return VLLMEngine(
            model_dir,
            dtype=r.dtype,
            seed=r.seed,
            tensor_parallel_size=r.tensor_model_parallel_size,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=r.max_num_seqs,
            max_num_batched_tokens=max(r.max_num_batched_tokens, max_model_len),
            enforce_eager=r.enforce_eager,
            trust_remote_code=trust,
            config_overrides=config_overrides,
            **placement,
        )
    if r.name == "megatron":
        from grpo_core.rollout.hf import load_generation_config, stop_ids
        from grpo_core.rollout.megatron import MegatronEngine

        return MegatronEngine.from_actor(
            actor,
            stop_ids(tokenizer, load_generation_config(model_dir, trust)),
            max_sequence_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
            max_batch_size=r.max_num_seqs,
            seed=r.seed,
        )
    if r.name == "static":
        from grpo_core.rollout.hf import load_generation_config, stop_ids
        from grpo_core.rollout.static import StaticEngine

        graphs = torch.cuda.is_available() and not r.enforce_eager
        return StaticEngine(  # starts without weights: the trainer pushes the actor's before the first rollout
            shape,
            stop_ids(tokenizer, load_generation_config(model_dir, trust)),
            dtype=r.dtype,
            device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu",
            max_batch_size=r.max_num_seqs,
            max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
            cuda_graphs=graphs,
            grow_length=not (graphs and r.free_cache_engine),  # graphs recaptured after every sleep: one, not several
        )
    raise ValueError(f"rollout engine {r.name!r} is not available; use vllm, hf, megatron or static")


__all__ = ["Generation", "RolloutEngine", "SamplingSettings", "build_engine", "draw", "to_rollout_batch"]
