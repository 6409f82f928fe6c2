"""What every rollout engine offers (HF here; vLLM and a megatron engine later) and its batch layout.

An engine turns token-id prompts into sampled responses plus the sampling policy's log-probs, takes
new weights from the trainer by HF parameter name, and may free its memory between rollouts. The
trainer only talks to this interface, so engines are swapped by construction, never by branching.
"""

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from grpo_core.data.batch import RolloutBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``rollout.dtype`` names: the engines' weight dtypes."""


@dataclass
class SamplingSettings:
    """How one ``generate`` call samples. Filled from ``rollout.*``, ``rollout.val_kwargs.*`` or ``evaluation.*``,
    whose defaults differ (temperature 1 and 0), so its defaults are no setting's: one plain sample, filters off."""

    n: int = 1  # samples per prompt (GRPO's group size)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1 is off
    top_k: int = -1  # -1 is off
    max_new_tokens: int = 512
    greedy: bool = False
    seed: int | None = None  # None: whatever state the engine's random generator is in
    greedy_baseline: bool = False  # also one greedy response per prompt (remax's baseline), apart from the samples

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            problems.append(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


@dataclass
class Generation:
    """The samples for P prompts with n samples each, grouped: prompt i owns rows i*n .. i*n+n-1.

    ``response_log_probs`` are the sampling policy's log-probs of each generated token at temperature 1
    (log_softmax of the raw logits, before temperature, top-p or top-k), i.e. the model's own
    distribution, comparable with the actor's log-probs whatever the sampling settings were.
    A response includes the EOS token that ended it; nothing after it.
    """

    prompt_ids: list[list[int]]  # [P]
    response_ids: list[list[int]]  # [P*n]
    response_log_probs: list[list[float]]  # [P*n], same lengths as response_ids
    finish_reasons: list[str]  # [P*n] "stop" (EOS ended it) or "length" (max_new_tokens did)
    group_index: list[int]  # [P*n] the prompt each row answers
    baseline_ids: list[list[int]] | None = None  # [P] a greedy response per prompt (remax), never trained on

    @classmethod
    def empty(cls, prompt_ids: list[list[int]] | None = None) -> "Generation":
        """No samples yet (for ``prompt_ids``): engines and gathers append to it."""
        return cls([list(p) for p in prompt_ids or []], [], [], [], [])

    @classmethod
    def concat(cls, parts: "Iterable[Generation]") -> "Generation":
        """The parts one after another, their prompt groups renumbered to follow on; baselines kept when every
        part has them."""
        merged, baselines = cls.empty(), []
        for part in parts:
            offset = len(merged.prompt_ids)
            merged.prompt_ids += part.prompt_ids
            merged.response_ids += part.response_ids
            merged.response_log_probs += part.response_log_probs
            merged.finish_reasons += part.finish_reasons
            merged.group_index += [g + offset for g in part.group_index]
            baselines = None if baselines is None or part.baseline_ids is None else baselines + part.baseline_ids
        merged.baseline_ids = baselines if merged.prompt_ids else None
        return merged

    def groups(self, chosen: list[int]) -> "Generation":
        """The prompts ``chosen`` (in that order) with their responses, renumbered 0 .. len(chosen) - 1."""
        rows = [[r for r, g in enumerate(self.group_index) if g == c] for c in chosen]
        order = [r for group in rows for r in group]
        return Generation(
            prompt_ids=[self.prompt_ids[c] for c in chosen],
            response_ids=[self.response_ids[r] for r in order],
            response_log_probs=[self.response_log_probs[r] for r in order],
            finish_reasons=[self.finish_reasons[r] for r in order],
            group_index=[i for i, group in enumerate(rows) for _ in group],
            baseline_ids=None if self.baseline_ids is None else [self.baseline_ids[c] for c in chosen],
        )

    def __post_init__(self) -> None:
        rows = len(self.response_ids)
        if not len(self.response_log_probs) == len(self.finish_reasons) == len(self.group_index) == rows:
            raise ValueError("response_ids, response_log_probs, finish_reasons and group_index differ in length")
        if any(len(ids) != len(lp) for ids, lp in zip(self.response_ids, self.response_log_probs, strict=True)):
            raise ValueError("each response needs exactly one log-prob per token")
        if self.baseline_ids is not None and len(self.baseline_ids) != len(self.prompt_ids):
            raise ValueError("baseline_ids needs one greedy response per prompt")


def generate_in_chunks(
    prompt_ids: list[list[int]], settings: SamplingSettings, per_chunk: int, device: torch.device, generate_chunk
) -> Generation:
    """Prompts ``per_chunk`` at a time through ``generate_chunk(prompts, settings) -> (responses, log-probs,
    finish reasons)``, grouped by prompt, under ``settings.seed`` when one is given."""
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    gen = Generation.empty(prompt_ids)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=settings.seed is not None):
        if settings.seed is not None:
            torch.manual_seed(settings.seed)
        for start in range(0, len(prompt_ids), per_chunk):
            chunk = prompt_ids[start : start + per_chunk]
            responses, log_probs, reasons = generate_chunk(chunk, settings)
            gen.response_ids += responses
            gen.response_log_probs += log_probs
            gen.finish_reasons += reasons
            gen.group_index += [start + i for i in range(len(chunk)) for _ in range(settings.n)]
    return gen


def draw(engine: "RolloutEngine", prompt_ids: list[list[int]], settings: SamplingSettings) -> Generation:
    """``engine.generate`` of the prompts, and with ``settings.greedy_baseline`` one greedy response per prompt
    beside the samples (``Generation.baseline_ids``): remax's baseline. The engines fix greedy or sampled decoding
    for a whole call (the static engine builds its decode step per mode), so the baseline is a second, greedy
    pass over the same prompts with the same weights, not extra rows of the sampled batch."""
    gen = engine.generate(prompt_ids, replace(settings, greedy_baseline=False))
    if settings.greedy_baseline:
        greedy = replace(settings, n=1, temperature=0.0, greedy=True, greedy_baseline=False)
        gen.baseline_ids = engine.generate(prompt_ids, greedy).response_ids
    return gen


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> Generation: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights, named as in the HF model's state dict."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory for the training phase (a no-op where unsupported)."""
        ...

    def wake(self) -> None:
        """Undo ``sleep`` before the next ``generate`` (a no-op where unsupported)."""
        ...


def to_rollout_batch(
    gen: Generation,
    pad_id: int,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
) -> RolloutBatch:
    """Rows of ``prompt (left-padded to P) + response (right-padded to R)``, one per sample.

    P and R default to the longest prompt and response; fixed values give every step the same shapes.
    Anything longer than them raises rather than being cut, since a cut prompt or response would be
    trained on as if it were whole. response_mask is 1 on every generated token, EOS included.
    rollout_log_probs are the engine's log-probs of the sampled tokens (for rollout importance sampling).
    """
    longest_prompt = max((len(p) for p in gen.prompt_ids), default=0)
    longest_response = max((len(r) for r in gen.response_ids), default=0)
    P = longest_prompt if max_prompt_len is None else max_prompt_len
    R = longest_response if max_response_len is None else max_response_len
    if longest_prompt > P:
        raise ValueError(f"a prompt has {longest_prompt} tokens, more than max_prompt_len={P}")
    if longest_response > R:
        raise ValueError(f"a response has {longest_response} tokens, more than max_response_len={R}")

    # each field as one flat tensor placed by a mask, not a tensor per row: 512 x 256 tokens in ~10 ms, not ~27
    prompts = [gen.prompt_ids[group] for group in gen.group_index]
    prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    response_len = torch.tensor([len(r) for r in gen.response_ids], dtype=torch.long)
    in_prompt = torch.arange(P) >= P - prompt_len[:, None]  # left-padded
    in_response = torch.arange(R) < response_len[:, None]  # right-padded

    B = len(gen.response_ids)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    input_ids[:, :P][in_prompt] = _flat(prompts, np.int64)
    input_ids[:, P:][in_response] = _flat(gen.response_ids, np.int64)
    rollout_log_probs = torch.zeros((B, R), dtype=torch.float32)
    rollout_log_probs[in_response] = _flat(gen.response_log_probs, np.float32)
    response_mask = in_response.long()
    attention_mask = torch.cat((in_prompt.long(), response_mask), dim=1)
    return RolloutBatch(input_ids, attention_mask, response_mask, rollout_log_probs=rollout_log_probs)


def _flat(rows: list[list], dtype: type) -> torch.Tensor:
    """Rows of Python numbers end to end as one tensor (numpy's loop: ~8x faster than torch.tensor on a list)."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(rows), dtype))
