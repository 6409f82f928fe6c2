"""A rollout engine on transformers' ``generate``: slow, but exact, dependency-free and runs on CPU.

It is the reference engine for tests, CPU demos and evaluating small models. It batches prompts with
left padding, samples ``n`` continuations each and returns the model's temperature-1 log-probs of the
sampled tokens, computed from the raw logits of each step (``output_logits``). Those logits are kept
for the whole call, so ``max_batch_size`` also bounds memory: about batch x new tokens x vocabulary.
"""

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from grpo_core.config.defaults import SETTING, defaults_from
from grpo_core.models.shape import overridden_fields
from grpo_core.rollout.base import DTYPES, Generation, SamplingSettings, generate_in_chunks

logger = logging.getLogger(__name__)


class ModelLoadError(Exception):
    """The model or tokenizer cannot be loaded; the message is one line meant for the user."""


def _short(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _check_local(path_or_id: str) -> None:
    """A path-like name that is not a directory is a typo, not a hub id: say so before any download."""
    path = Path(path_or_id).expanduser()
    path_like = path.exists() or path_or_id.startswith((".", "/", "~")) or path_or_id.count("/") > 1
    if path_like and not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise ModelLoadError(f"model directory {path} {problem}")


@defaults_from("actor_rollout_ref.model")
def load_tokenizer(path_or_id: str, trust_remote_code: bool = SETTING):
    """Left padding (so every prompt ends where generation starts); EOS doubles as padding if needed."""
    _check_local(path_or_id)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path_or_id, padding_side="left", trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"could not load a tokenizer from {path_or_id!r}: {_short(exc)}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@defaults_from("actor_rollout_ref.model")
def load_model(
    path_or_id: str, dtype: str = "float32", trust_remote_code: bool = SETTING, config_overrides: dict | None = None
) -> PreTrainedModel:
    """``config_overrides``: Hugging Face config fields set before the model is built
    (``actor_rollout_ref.model.override_config.model_config``)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {list(DTYPES)}")
    _check_local(path_or_id)
    try:
        extra = {}
        if config_overrides:
            config = AutoConfig.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
            config.update(overridden_fields(config.to_dict(), config_overrides))
            extra["config"] = config
        model = AutoModelForCausalLM.from_pretrained(
            path_or_id, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, **extra
        )
    except Exception as exc:
        raise ModelLoadError(f"could not load a causal LM from {path_or_id!r}: {_short(exc)}") from exc
    return model


def _as_list(ids: int | list[int] | None) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def stop_ids(tokenizer, generation_config: GenerationConfig) -> list[int]:
    """The tokenizer's EOS first (it pads when there is no pad token), then the checkpoint's extra stop ids."""
    ids = list(dict.fromkeys(_as_list(tokenizer.eos_token_id) + _as_list(generation_config.eos_token_id)))
    if not ids:
        raise ModelLoadError("neither the tokenizer nor the model's generation config names an EOS token")
    return ids


def load_generation_config(path_or_id: str, trust_remote_code: bool) -> GenerationConfig:
    """generation_config.json, else what transformers derives from config.json (as a loaded model has)."""
    try:
        return GenerationConfig.from_pretrained(path_or_id)
    except OSError:
        config = AutoConfig.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
        return GenerationConfig.from_model_config(config)


class HFEngine:
    """Implements ``RolloutEngine``. The engine owns the module: it replaces its generation_config
    (a checkpoint's defaults such as repetition_penalty would silently change the sampled
    distribution) and ``update_weights`` writes into it. ``dtype`` applies when loading from a path;
    a module is used in its own dtype.
    """

    @defaults_from("actor_rollout_ref.model")
    def __init__(
        self,
        model_path_or_module: str | Path | PreTrainedModel,
        tokenizer,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 32,
        trust_remote_code: bool = SETTING,
        config_overrides: dict | None = None,
    ) -> None:
        if isinstance(model_path_or_module, str | Path):
            model = load_model(str(model_path_or_module), dtype, trust_remote_code, config_overrides)
        else:
            model = model_path_or_module
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.eos_ids = stop_ids(tokenizer, model.generation_config)
        pad = tokenizer.pad_token_id
        self.pad_id = self.eos_ids[0] if pad is None else pad
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id)

    def _sample_config(self, settings: SamplingSettings, n: int) -> GenerationConfig:
        """Every sampling knob set explicitly, so nothing falls back to a default we did not choose."""
        common = dict(max_new_tokens=settings.max_new_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        common |= dict(return_dict_in_generate=True, output_logits=True, num_return_sequences=n)
        if settings.is_greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=0 if settings.top_k == -1 else settings.top_k,
            **common,
        )

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: list[list[int]], settings: SamplingSettings
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """(response ids, log-probs, finish reasons) for each prompt x sample, grouped by prompt."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        # Greedy samples of one prompt are identical: generate one and repeat it.
        copies = 1 if settings.is_greedy else settings.n
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=self._sample_config(settings, copies),
        )
        tokens = out.sequences[:, width:]  # [rows, T]
        # out.logits: T steps of [rows, V] raw logits (before temperature, top-p, top-k); one step at a
        # time, so the fp32 log-softmax never holds more than one step's vocabulary.
        log_probs = torch.stack(
            [
                torch.log_softmax(step.float(), -1).gather(-1, tokens[:, t, None])[:, 0]
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )  # [rows, T]
        eos = torch.isin(tokens, torch.tensor(self.eos_ids, device=tokens.device))
        responses, token_log_probs, reasons = [], [], []
        for row in range(tokens.shape[0]):
            hits = eos[row].nonzero()
            length = int(hits[0]) + 1 if len(hits) else tokens.shape[1]
            for _ in range(settings.n // copies):
                responses.append(tokens[row, :length].tolist())
                token_log_probs.append(log_probs[row, :length].tolist())
                reasons.append("stop" if len(hits) else "length")
        return responses, token_log_probs, reasons

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> Generation:
        """Prompts go in chunks of at most ``max_batch_size`` sequences (at least one prompt each)."""
        per_chunk = max(1, self.max_batch_size // settings.n)
        return generate_in_chunks(prompt_ids, settings, per_chunk, self.device, self._generate_chunk)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the parameter or buffer of that HF name, converting dtype and device.

        Tied weights are one tensor under two names, so pushing ``model.embed_tokens.weight`` also
        updates a tied ``lm_head.weight``. An unknown name or a wrong shape raises at once; tensors
        copied before it stay copied, so after that error the engine's weights are a mix.
        """
        targets = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            if name not in targets:
                raise KeyError(f"update_weights: the model has no parameter named {name!r}")
            target = targets[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)

    def sleep(self) -> None:
        if self.device.type != "cpu":
            self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)
