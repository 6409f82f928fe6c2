"""A rollout engine on megatron-core's own inference stack, generating from the actor's GPTModel.

It runs megatron's static-batch path: ``GPTInferenceWrapper`` over a ``StaticInferenceContext`` (a
preallocated [max_sequence_length, max_batch_size] KV cache per layer) and
``TextGenerationController.generate_all_output_tokens_static_batch``. That path needs neither
Transformer Engine nor flash-attn, so it runs with our local spec (SDPA core attention) on GPUs and,
through ``cpu_compat``, on CPUs. The dynamic engine does not: its paged attention calls flash-attn
kernels (``Attention.flash_decode_and_prefill``), and ``StaticInferenceEngine`` without ``legacy=True``
tries that engine first. We call the controller directly rather than through
``StaticInferenceEngine(legacy=True)``, which adds only a request queue and a progress bar, and
reseeds torch's global RNG on every ``generate``.

The engine shares the actor's parameters, so there are no weights to sync: ``update_weights`` is a
no-op. Every tensor-parallel rank of the model must call ``generate`` with the same prompts (the
forward is collective); pipeline parallelism and sequence parallelism are not supported.

Simplifications, against ``HFEngine``: one sampling setting per call, as megatron's sampler takes
``top_k`` or ``top_p`` but not both; prompts are right-padded and the batch prefills up to its
shortest prompt, then feeds the longer prompts' tokens one step at a time. Log-probs are taken from
each step's last-token logits as the tokens are sampled, not with the controller's
``return_log_probs``: that would also score every prompt token, materialising the prefill's logits
over the whole vocabulary ([rows, shortest prompt, vocab], in fp32 after the log-softmax).
"""

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

from grpo_core import cpu_compat
from grpo_core.rollout.base import Generation, SamplingSettings

try:  # megatron-core 0.19: a process-wide "an inference engine is using the model" flag
    from megatron.core.inference.utils import InferenceMode
except ImportError:  # 0.16
    InferenceMode = None

try:  # megatron-core 0.16 sizes the wrapper from this config; 0.19 removed it
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
except ImportError:
    InferenceWrapperConfig = None


class _Tokenizer:
    """What the controller asks of a tokenizer when it is given token ids: the id it pads with, and
    text it would attach to each request (we return none: the trainer works on ids)."""

    def __init__(self, eod: int):
        self.eod = eod

    def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


class _Wrapper(GPTInferenceWrapper):
    """Masks the padded vocabulary columns (present when TP does not divide the vocabulary), so they
    are never sampled and do not enter the log-softmax."""

    vocab_size: int

    def run_one_forward_step(self, *args, **kwargs):
        logits = super().run_one_forward_step(*args, **kwargs)
        if logits is not None and logits.shape[-1] > self.vocab_size:
            logits[..., self.vocab_size :] = float("-inf")
        return logits


class _Controller(TextGenerationController):
    """Stops a row at any of several stop ids (megatron takes one), and counts the stop token in the
    row's length, so responses end with it as the ``Generation`` contract says. Keeps the temperature-1
    log-prob of every step's sampled tokens in ``step_log_probs`` (one [rows] tensor per step)."""

    stop_ids: torch.Tensor
    step_log_probs: list[torch.Tensor]

    def sample_from_logits(self, last_token_logits, *args, **kwargs):
        tokens = super().sample_from_logits(last_token_logits, *args, **kwargs)
        log_probs = torch.log_softmax(last_token_logits.float(), dim=-1)  # the sampler filtered a copy
        self.step_log_probs.append(log_probs.gather(1, tokens.long()[:, None])[:, 0])
        return tokens

    def update_generation_status(
        self,
        updated_prompts_tokens,
        generation_started,
        current_context_end_position,
        is_generation_done_tensor,
        generated_sequence_lengths,
        termination_id=None,
    ):
        latest = updated_prompts_tokens[:, current_context_end_position]
        active = generation_started & ~is_generation_done_tensor
        generated_sequence_lengths += active
        stopped = active & torch.isin(latest, self.stop_ids.to(latest.device))
        return is_generation_done_tensor | stopped, generated_sequence_lengths.int()


class MegatronEngine:
    """Implements ``RolloutEngine`` on a megatron ``GPTModel`` (the actor's, shared, not copied).

    ``max_sequence_length`` (longest prompt + max_new_tokens) and ``max_batch_size`` (rows per forward)
    size the KV cache: 2 x layers x max_sequence_length x max_batch_size x KV width, allocated on the
    first ``generate`` and kept until ``sleep``. ``before_generate`` runs at the start of each call;
    ``from_actor`` passes the actor's ``reload_parameters`` so offloaded parameters are back first.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int,
        stop_ids: list[int],
        max_sequence_length: int,
        max_batch_size: int = 32,
        before_generate: Callable[[], object] | None = None,
        seed: int | None = None,
    ):
        model = getattr(model, "module", model)  # a DDP-wrapped chunk: the GPTModel inside
        config = model.config
        if config.pipeline_model_parallel_size > 1:
            raise NotImplementedError("MegatronEngine runs without pipeline parallelism only")
        if config.sequence_parallel:
            raise NotImplementedError("megatron's static inference refuses sequence parallelism without MoE")
        if not stop_ids:
            raise ValueError("MegatronEngine needs at least one stop id")
        self.model, self.vocab_size, self.stop_ids = model, vocab_size, list(dict.fromkeys(stop_ids))
        self.max_sequence_length, self.max_batch_size = max_sequence_length, max_batch_size
        self.before_generate = before_generate

        self.context = StaticInferenceContext(max_batch_size, max_sequence_length)
        if InferenceWrapperConfig is not None:  # 0.16
            sizes = InferenceWrapperConfig(
                hidden_size=config.hidden_size,
                params_dtype=config.params_dtype,
                inference_batch_times_seqlen_threshold=-1,
                padded_vocab_size=model.vocab_size,
                inference_max_requests=max_batch_size,
                inference_max_seq_length=max_sequence_length,
            )
            wrapped = _Wrapper(model, sizes, self.context)
        else:  # 0.19
            wrapped = _Wrapper(model, self.context)
        wrapped.vocab_size = vocab_size
        with cpu_compat.current_device_is_cpu():  # it builds a torch.Generator there
            self.controller = _Controller(wrapped, _Tokenizer(self.stop_ids[0]))
        self.controller.stop_ids = torch.tensor(self.stop_ids, dtype=torch.long)
        if seed is not None:  # the sampling stream's start (megatron's own default: inference_sampling_seed)
            self.controller.sampling_rng.manual_seed(seed)

    @classmethod
    def from_actor(
        cls, actor, stop_ids: list[int], max_sequence_length: int, max_batch_size: int = 32, seed: int | None = None
    ):
        """On a ``MegatronActor`` (TP only): its first model chunk, its vocabulary, its host offload."""
        if len(actor.model) != 1:
            raise NotImplementedError("MegatronEngine needs one model chunk (no virtual pipeline stages)")
        return cls(
            actor.model[0],
            actor.shape.vocab_size,
            stop_ids,
            max_sequence_length,
            max_batch_size,
            before_generate=actor.reload_parameters,
            seed=seed,
        )

    def _sampling_params(self, settings: SamplingSettings) -> SamplingParams:
        common = dict(num_tokens_to_generate=settings.max_new_tokens, return_log_probs=False)  # see _Controller
        if settings.is_greedy:
            return SamplingParams(temperature=1.0, top_k=1, **common)
        top_k = 0 if settings.top_k == -1 else settings.top_k
        top_p = 0.0 if settings.top_p == 1 else settings.top_p
        if top_k and top_p:
            raise ValueError("megatron's sampler takes top_k or top_p, not both")
        return SamplingParams(temperature=settings.temperature, top_k=top_k, top_p=top_p, **common)

    def _generate_chunk(self, rows: list[list[int]], params: SamplingParams):
        """(response ids, log-probs, finish reasons) of each row, in order."""
        requests = OrderedDict(
            (str(i), InferenceRequest(request_id=str(i), prompt="", prompt_tokens=list(p), sampling_params=params))
            for i, p in enumerate(rows)
        )
        self.controller.step_log_probs = []
        done = self.controller.generate_all_output_tokens_static_batch(requests)
        steps = torch.stack(self.controller.step_log_probs, dim=1).tolist()  # [rows, steps]
        shortest = min(len(p) for p in rows)  # the prefill ends there and samples the first step
        responses, log_probs, reasons = [], [], []
        for request, prompt, row_steps in zip(done.values(), rows, steps, strict=True):
            ids = request.generated_tokens.tolist()
            first = len(prompt) - shortest  # the step that sampled this row's first token
            responses.append(ids)
            log_probs.append(row_steps[first : first + len(ids)])
            reasons.append("stop" if ids and ids[-1] in self.stop_ids else "length")
        return responses, log_probs, reasons

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> Generation:
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        longest = max((len(p) for p in prompt_ids), default=0) + settings.max_new_tokens
        if longest > self.max_sequence_length:
            raise ValueError(
                f"prompt + max_new_tokens = {longest} tokens > max_sequence_length={self.max_sequence_length}"
            )
        if self.before_generate is not None:
            self.before_generate()
        params = self._sampling_params(settings)
        copies = 1 if settings.is_greedy else settings.n  # greedy samples of one prompt are identical
        rows = [p for p in prompt_ids for _ in range(copies)]
        gen = Generation.empty(prompt_ids)
        rng = self.controller.sampling_rng  # the controller's own generator: torch's global RNG is untouched
        saved = rng.get_state()
        if settings.seed is not None:
            rng.manual_seed(settings.seed)
        was_training = self.model.training
        # 0.19's flag must be down again afterwards: while it is up, the actor's forward fails
        # (GPTModel._postprocess asserts "Inference must always gather TP logits").
        mode = InferenceMode.active() if InferenceMode is not None else contextlib.nullcontext()
        try:
            with mode:
                for start in range(0, len(rows), self.max_batch_size):
                    responses, log_probs, reasons = self._generate_chunk(
                        rows[start : start + self.max_batch_size], params
                    )
                    gen.response_ids += responses
                    gen.response_log_probs += log_probs
                    gen.finish_reasons += reasons
        finally:
            self.model.train(was_training)
            if settings.seed is not None:
                rng.set_state(saved)
        if copies != settings.n:
            repeat = settings.n
            gen.response_ids = [r for r in gen.response_ids for _ in range(repeat)]
            gen.response_log_probs = [lp for lp in gen.response_log_probs for _ in range(repeat)]
            gen.finish_reasons = [f for f in gen.finish_reasons for _ in range(repeat)]
        gen.group_index = [i for i in range(len(prompt_ids)) for _ in range(settings.n)]
        return gen

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: the engine generates from the actor's own parameters (the trainer's
        ``sync_weights`` does not gather them for this engine)."""

    def sleep(self) -> None:
        """Drop the KV cache (reallocated by the next ``generate``); the weights are the actor's."""
        self.context.key_value_memory_dict.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake(self) -> None:
        pass
