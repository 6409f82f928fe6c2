"""The rollout engines by name (verl's hf, vllm and megatron; static, ours) and the one place each is built.

Training (``actor_rollout_ref.rollout.name``) and evaluation (``evaluation.engine``) both call ``build_engine``:
each states what it needs in an ``EngineRequest`` and the engine's builder turns that into the engine's own
arguments. An engine's module is imported when it is built: vLLM, transformers and megatron are heavy, and a
run uses one of them.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_core.config.defaults import SETTING, defaults_from, schema_default
from grpo_core.models.shape import ModelShape, load_model_shape
from grpo_core.rollout.base import RolloutEngine


@dataclass(frozen=True)
@defaults_from("actor_rollout_ref.rollout")
class EngineRequest:
    """What an engine is built from. Every caller gives the first seven fields (each engine reads those it needs); each
    later one names the engines that read it. Training gives the later ones from ``actor_rollout_ref.rollout``, whose
    schema defaults they have; evaluation, which builds hf or static alone (never put to sleep), leaves them out."""

    model_dir: str  # the HF model: weights (hf, vllm, static without ``push_weights``), generation config, config
    tokenizer: object
    dtype: str
    device: str  # hf, static: where the engine runs ("cuda:N", "cuda" or "cpu")
    max_batch_size: int  # sequences generated at once (vllm: max_num_seqs)
    max_model_len: int  # prompt + response tokens a sequence may hold
    trust_remote_code: bool
    shape: ModelShape | None = None  # vllm on a CPU, static: the model's shape (None: read from model_dir)
    config_overrides: dict | None = None  # hf, vllm: HF config overrides (``hf_overrides`` of model.override_config)
    seed: int = SETTING  # vllm, megatron: the engine's own sampling seed
    push_weights: bool = False  # static: built empty, the caller pushes weights (``update_weights``); else loaded
    actor: object | None = None  # megatron: the ``MegatronActor`` whose model generates
    tensor_parallel_size: int = schema_default("actor_rollout_ref.rollout.tensor_model_parallel_size")  # vllm
    gpu_memory_utilization: float = SETTING  # vllm (on GPUs)
    max_num_batched_tokens: int = SETTING  # vllm: its scheduler's token budget (at least max_model_len)
    enforce_eager: bool = SETTING  # vllm, static: no CUDA graphs
    free_cache_engine: bool = False  # static: slept after every rollout, so its graphs are recaptured at each wake
    setting: str = "actor_rollout_ref.rollout.name"  # static: the config key that chose the engine, for messages
    alternatives: str = "vllm or hf"  # static: the engines that key could name instead, for messages

    def model_shape(self) -> ModelShape:
        return self.shape if self.shape is not None else load_model_shape(self.model_dir)


def build_engine(name: str, request: EngineRequest) -> RolloutEngine:
    """The engine called ``name`` (a key of ``ENGINES``), built as ``request`` asks."""
    if name not in ENGINES:
        raise ValueError(f"rollout engine {name!r} is not available; use vllm, hf, megatron or static")
    return ENGINES[name](request)


def _hf(r: EngineRequest) -> RolloutEngine:
    """transformers' ``generate``: any causal LM, on one device."""
    from grpo_core.rollout.hf import HFEngine

    return HFEngine(
        r.model_dir,
        r.tokenizer,
        dtype=r.dtype,
        device=r.device,
        max_batch_size=r.max_batch_size,
        trust_remote_code=r.trust_remote_code,
        config_overrides=r.config_overrides,
    )


def _vllm(r: EngineRequest) -> RolloutEngine:
    """vLLM in its own processes, on this rank's GPU and those of its rollout-TP peers (or on the CPU)."""
    from grpo_core.rollout.hf import DTYPES
    from grpo_core.rollout.vllm import VLLMEngine

    placement: dict = {}
    if torch.cuda.is_available():  # this rank's GPU and those of its rollout-TP peers
        first = int(os.environ.get("LOCAL_RANK", "0"))
        placement["device_ids"] = list(range(first, first + r.tensor_parallel_size))
    else:  # on a CPU, gpu_memory_utilization would be a share of host RAM: size the KV cache instead
        shape = r.model_shape()
        kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPES[r.dtype].itemsize
        placement["kv_cache_memory_bytes"] = kv_per_token * r.max_model_len * r.max_batch_size + (64 << 20)
    return VLLMEngine(
        r.model_dir,
        dtype=r.dtype,
        seed=r.seed,
        tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_model_len=r.max_model_len,
        max_num_seqs=r.max_batch_size,
        max_num_batched_tokens=max(r.max_num_batched_tokens, r.max_model_len),
        enforce_eager=r.enforce_eager,
        trust_remote_code=r.trust_remote_code,
        config_overrides=r.config_overrides,
        **placement,
    )


def _megatron(r: EngineRequest) -> RolloutEngine:
    """megatron-core's static inference on the actor's own model (every rank runs its TP shard)."""
    from grpo_core.rollout.hf import load_generation_config, stop_ids
    from grpo_core.rollout.megatron import MegatronEngine

    if r.actor is None:
        raise ValueError("the megatron rollout engine generates with the actor's model: build it with an actor")
    return MegatronEngine.from_actor(
        r.actor,
        stop_ids(r.tokenizer, load_generation_config(r.model_dir, r.trust_remote_code)),
        max_sequence_length=r.max_model_len,
        max_batch_size=r.max_batch_size,
        seed=r.seed,
    )


def _static(r: EngineRequest) -> RolloutEngine:
    """Ours (``static.py``): dense Llama/Qwen2/Qwen3; ModelLoadError for another model."""
    from grpo_core.rollout.hf import ModelLoadError, load_generation_config, stop_ids
    from grpo_core.rollout.static import StaticEngine, unsupported

    shape = r.model_shape()
    if problem := unsupported(shape, key=r.setting, instead=r.alternatives):
        raise ModelLoadError(problem)
    graphs = torch.cuda.is_available() and not r.enforce_eager
    engine = StaticEngine(
        shape,
        stop_ids(r.tokenizer, load_generation_config(r.model_dir, r.trust_remote_code)),
        dtype=r.dtype,
        device=r.device,
        max_batch_size=r.max_batch_size,
        max_model_len=r.max_model_len,
        cuda_graphs=graphs,
        grow_length=not (graphs and r.free_cache_engine),  # graphs recaptured after every sleep: one, not several
    )
    return engine if r.push_weights else engine.load(r.model_dir)


ENGINES: dict[str, Callable[[EngineRequest], RolloutEngine]] = {
    "hf": _hf,
    "vllm": _vllm,
    "megatron": _megatron,
    "static": _static,
}
