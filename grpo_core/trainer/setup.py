"""A training run's set-up, on every rank: parallel state, tokenizer and prompts, reward, the actor (and reference)
with their initial weights, this rank's rollout engine, and what every checkpoint records.

``set_up`` returns the ``TrainingSetup`` that the loop (loop.py) hands to every step.
"""

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from grpo_core import actor as _cpu_compat  # noqa: F401  (must precede megatron)
from grpo_core.actor.actor import ActorSettings, MegatronActor
from grpo_core.actor.parallel import init_model_parallel
from grpo_core.checkpoint.manager import CheckpointManager, contents_setting
from grpo_core.config import GRPOConfig
from grpo_core.cpu_memory import keep_freed_memory
from grpo_core.data.prompts import Prompt, PromptSampler, load_prompts, position_data, start_rows_seen
from grpo_core.models.shape import ModelShape, hf_overrides, model_weights_dir, read_hf_config, with_overrides
from grpo_core.planning.layout import actor_layout
from grpo_core.quiet import SET_UP
from grpo_core.rewards import Scorer, build_scorer
from grpo_core.rollout import EngineRequest, SamplingSettings, build_engine
from grpo_core.rollout.hf import load_tokenizer
from grpo_core.trainer.rollouts import rollout_sampling

logger = logging.getLogger(__name__)


@dataclass
class TrainingSetup:
    """What set-up builds and every step uses: the models, this rank's rollout engine, the data, the reward."""

    cfg: GRPOConfig
    shape: ModelShape
    rank: int
    actor: MegatronActor
    ref: MegatronActor | None  # frozen initial policy, for a KL loss or a KL penalty in the reward (not with LoRA)
    engine: object | None  # this rank's rollout engine (None: this rank only joins the gathers and syncs)
    tokenizer: object
    sampler: PromptSampler
    dropped: int  # training prompts dropped as longer than data.max_prompt_length
    val_prompts: list[Prompt]
    scorer: Scorer
    sampling: SamplingSettings
    total_steps: int
    checkpoints: CheckpointManager
    save_contents: frozenset
    load_contents: frozenset
    trainer_state: dict  # what every checkpoint records besides the weights (and the data position)
    said: set[str] = field(default_factory=set)  # the once-a-run warnings given so far


@dataclass
class TrainingData:
    """The prompts of a run: the training set's, in the order it draws them, and the validation set's."""

    sampler: PromptSampler
    rows: int  # training prompts kept
    dropped: int  # training prompts dropped as longer than data.max_prompt_length
    val_prompts: list[Prompt]


def set_up(cfg: GRPOConfig, shape: ModelShape) -> TrainingSetup:
    """Parallel state, tokenizer, prompts, reward, actor (and ref) with their initial weights, rollout engine."""
    arr, model_cfg = cfg.actor_rollout_ref, cfg.actor_rollout_ref.model
    started = time.perf_counter()
    if cfg.trainer.device == "cpu":
        keep_freed_memory()
    layout = actor_layout(cfg)
    init_model_parallel(layout, seed=arr.actor.megatron.seed, timeout_s=arr.nccl_timeout)
    rank = dist.get_rank()

    def status(what: str) -> None:
        if rank == 0:
            logger.info("%s%s (%.0f s)", SET_UP, what, time.perf_counter() - started)

    status(f"loading the tokenizer and data of {model_cfg.path}")
    model_dir, tokenizer_dir = model_files(cfg, rank)
    tokenizer = load_tokenizer(str(tokenizer_dir), model_cfg.trust_remote_code)
    data = load_data(cfg, tokenizer, model_dir, rank)
    scorer = build_scorer(cfg)
    total_steps = cfg.trainer.total_training_steps or data.sampler.steps_per_epoch * cfg.trainer.total_epochs
    mini_batches = cfg.data.train_batch_size // arr.actor.ppo_mini_batch_size
    optimizer_steps = total_steps * arr.actor.ppo_epochs * mini_batches

    settings = ActorSettings.from_config(cfg, layout, arr.actor.optim.total_training_steps or optimizer_steps)
    status(f"building the actor ({layout.describe()}) and loading its weights")
    actor = MegatronActor(shape, settings, hf_path=str(model_dir), adapter_path=model_cfg.lora.start)
    # with LoRA the reference is the actor with its adapters off: no second model
    needs_model = needs_ref(cfg) and not settings.lora.enabled
    ref = MegatronActor(shape, settings, hf_path=str(model_dir), trainable=False) if needs_model else None
    on_rank = rank % arr.rollout.tensor_model_parallel_size == 0 or engine_is_the_actor(cfg)
    status(f"building the {arr.rollout.name} rollout engine")
    engine = None  # this rank only joins the gathers and syncs
    if on_rank:
        engine = build_engine(arr.rollout.name, engine_request(cfg, shape, str(model_dir), tokenizer, actor))
    status(f"ready; step 1 of {total_steps} starts (the first may take longer: it compiles kernels)")
    # rollout.seed decides what is sampled, on every rank alike (rollout TP ranks must draw the same tokens): the
    # static and HF engines draw from torch's default generators, which megatron seeded with actor.megatron.seed;
    # vLLM's and megatron's engines take it as their own. A resumed run then restores the generators it saved.
    torch.manual_seed(arr.rollout.seed)

    save_contents, load_contents = contents_setting(arr.actor.checkpoint)
    return TrainingSetup(
        cfg=cfg,
        shape=shape,
        rank=rank,
        actor=actor,
        ref=ref,
        engine=engine,
        tokenizer=tokenizer,
        sampler=data.sampler,
        dropped=data.dropped,
        val_prompts=data.val_prompts,
        scorer=scorer,
        sampling=rollout_sampling(cfg),
        total_steps=total_steps,
        checkpoints=CheckpointManager.for_run(cfg.trainer),
        save_contents=save_contents,
        load_contents=load_contents,
        trainer_state=checkpoint_state(cfg, settings, model_dir, tokenizer_dir, data.rows),
    )


def model_files(cfg: GRPOConfig, rank: int) -> tuple[Path, Path]:
    """The model's and the tokenizer's local directories. Rank 0 downloads from the hub (if not local) while the
    others wait for the cache."""
    model_cfg = cfg.actor_rollout_ref.model
    if rank != 0:
        dist.barrier()
    model_dir = model_weights_dir(model_cfg.path)
    tokenizer_dir = model_weights_dir(model_cfg.tokenizer_path) if model_cfg.tokenizer_path else model_dir
    if rank == 0:
        dist.barrier()
    return model_dir, tokenizer_dir


def load_data(cfg: GRPOConfig, tokenizer, model_dir: Path, rank: int) -> TrainingData:
    """The training prompts (the rows the start model's training drew after the others) and, when the run
    validates, the validation prompts."""
    d = cfg.data
    train_prompts, dropped = load_prompts(
        d.train_files, tokenizer, d.max_prompt_length, d.filter_overlong_prompts, d.truncation, prompt_key=d.prompt_key
    )
    val_prompts = []
    if _validates(cfg):
        val_prompts = load_prompts(d.val_files, tokenizer, d.max_prompt_length, prompt_key=d.prompt_key)[0]
    adapter = cfg.actor_rollout_ref.model.lora.start  # a PEFT adapter the adapters start from (else their init)
    seen = start_rows_seen(model_dir, adapter)  # rows the start model's training drew: they come after the others
    sampler = PromptSampler(train_prompts, d.train_batch_size, d.shuffle, d.seed, seen)
    if seen and rank == 0:
        new, rows = sampler.new_rows, len(train_prompts)
        logger.info("%d of the %d training rows are new to the start model: first in every epoch", new, rows)
    return TrainingData(sampler, len(train_prompts), dropped, val_prompts)


def engine_request(
    cfg: GRPOConfig, shape: ModelShape, model_dir: str, tokenizer, actor: MegatronActor
) -> EngineRequest:
    """This rank's rollout engine as ``actor_rollout_ref.rollout`` sets it, on this rank's device; the static
    engine starts without weights (the actor's are pushed before the first rollout), megatron's generates with
    ``actor``'s own model."""
    r, model_cfg = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    return EngineRequest(
        model_dir,
        tokenizer,
        dtype=r.dtype,
        device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu",
        max_batch_size=r.max_num_seqs,
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        trust_remote_code=model_cfg.trust_remote_code,
        shape=shape,
        config_overrides=hf_overrides(model_cfg.override_config),
        seed=r.seed,
        push_weights=True,
        actor=actor,
        tensor_parallel_size=r.tensor_model_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_batched_tokens=r.max_num_batched_tokens,
        enforce_eager=r.enforce_eager,
        free_cache_engine=r.free_cache_engine,
    )


def checkpoint_state(cfg: GRPOConfig, settings: ActorSettings, model_dir: Path, tokenizer_dir: Path, rows: int) -> dict:
    """What every checkpoint records besides the weights (and the data position): the model's HF config, the
    tokenizer, what the data position counts in, and with LoRA the adapters' settings and their base."""
    model_cfg = cfg.actor_rollout_ref.model
    state = {
        "hf_config": with_overrides(read_hf_config(str(model_dir)), hf_overrides(model_cfg.override_config)),
        "dtype": settings.dtype,
        "tokenizer_path": str(tokenizer_dir),
        # what the data position counts in: the training set, and the rows its start model had seen
        "data": {**position_data(cfg.data.train_files, model_dir, model_cfg.lora.start), "rows": rows},
    }
    if settings.lora.enabled:  # a LoRA checkpoint holds adapters: it names the base they belong to
        state["lora"] = {**settings.lora.record(), "base_model": model_cfg.path}
    return state


def _validates(cfg: GRPOConfig) -> bool:
    return cfg.trainer.val_before_train or cfg.trainer.test_freq > 0


def engine_is_the_actor(cfg: GRPOConfig) -> bool:
    """The megatron engine generates with the actor's model: on every rank, with nothing to sync."""
    return cfg.actor_rollout_ref.rollout.name == "megatron"


def needs_ref(cfg: GRPOConfig) -> bool:
    """A KL loss or a KL penalty in the reward needs the reference policy's log-probs."""
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
