"""What the actor needs from the config tree (``actor_rollout_ref.actor``, its ``optim`` and ``megatron``): the
actor's constructor API. No megatron import, so the settings are built and checked before any rank starts."""

from dataclasses import dataclass, fields

from grpo_core.actor.loss import LossSettings
from grpo_core.config.defaults import SETTING, defaults_from, schema_default, section_values
from grpo_core.models.lora_settings import LoRASettings
from grpo_core.planning.layout import ParallelLayout

SECTIONS = ("actor_rollout_ref.actor.optim", "actor_rollout_ref.actor.megatron", "actor_rollout_ref.actor")
"""The config sections whose settings ActorSettings takes by name, in the order a name is looked up."""

ACTOR = "actor_rollout_ref.actor"


@dataclass(frozen=True)
@defaults_from(*SECTIONS)
class ActorSettings:
    """The actor's settings. A field named like a setting of SECTIONS defaults to the schema's, and so does one
    renamed from it; the others are the actor's own, for an actor built directly (tests, export): float32, no
    sequence parallelism, no packing, a mini-batch of 8 rows, each an explicit mapping in ``from_config``."""

    layout: ParallelLayout
    dtype: str = "float32"
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = SETTING
    optimizer_offload: bool = SETTING  # Adam states in host memory, step on the CPU (GPU runs only)
    optimizer_overrides: dict | None = None  # megatron OptimizerConfig fields (override_optimizer_config)
    # the optimizer saved loadable at any TP/PP (see planning/memory.py)
    reshardable_checkpoint: bool = schema_default(f"{ACTOR}.megatron.dist_ckpt_optim_fully_reshardable")
    recompute: bool = schema_default("actor_rollout_ref.model.enable_gradient_checkpointing")
    transformer_overrides: dict | None = None
    lr: float = SETTING
    min_lr: float = SETTING
    weight_decay: float = SETTING
    adam_beta1: float = SETTING
    adam_beta2: float = SETTING
    lr_warmup_steps: int = 0  # resolved: optim.lr_warmup_steps, or its ratio of the total steps
    lr_decay_style: str = SETTING
    total_optimizer_steps: int = 1
    grad_clip: float = SETTING
    initial_loss_scale: float = SETTING
    mini_batch_rows: int = 8  # responses per optimizer step (ppo_mini_batch_size x rollout.n)
    # responses per forward/backward on one GPU
    micro_batch_rows: int = schema_default(f"{ACTOR}.ppo_micro_batch_size_per_gpu")
    micro_batch_tokens: int | None = None  # instead: as many responses as fit this many tokens (dynamic bsz)
    pack_sequences: bool = False  # a micro-batch's rows without padding, end to end (thd)
    ppo_epochs: int = SETTING
    shuffle_seed: int | None = None  # actor.shuffle: rows reshuffled between mini-batches by this seed (data.seed)
    loss: LossSettings = LossSettings()
    lora: LoRASettings = LoRASettings()  # rank > 0: adapters on the frozen base (models/lora.py)

    @classmethod
    def from_config(cls, cfg, layout: ParallelLayout, total_optimizer_steps: int) -> "ActorSettings":
        """From the resolved ``GRPOConfig``: each setting of the same name in SECTIONS, then verl's keys mapped onto
        what the actor needs."""
        actor, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
        m, optim, model = actor.megatron, actor.optim, cfg.actor_rollout_ref.model
        warmup = optim.lr_warmup_steps
        if warmup < 0:
            warmup = int(optim.lr_warmup_steps_ratio * total_optimizer_steps)
        overrides = dict(m.override_transformer_config)
        mapped = dict(
            layout=layout,
            optimizer_overrides=dict(optim.override_optimizer_config),
            reshardable_checkpoint=m.dist_ckpt_optim_fully_reshardable,
            recompute=model.enable_gradient_checkpointing and "recompute_granularity" not in overrides,
            transformer_overrides=overrides,
            lr_warmup_steps=warmup,
            total_optimizer_steps=total_optimizer_steps,
            mini_batch_rows=actor.ppo_mini_batch_size * n,
            micro_batch_rows=actor.ppo_micro_batch_size_per_gpu,
            micro_batch_tokens=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
            # packed sequences need attention per sequence: not split over context-parallel ranks here
            pack_sequences=model.use_remove_padding and layout.cp == 1,
            shuffle_seed=(1 if cfg.data.seed is None else cfg.data.seed) if actor.shuffle else None,
            loss=LossSettings.from_config(cfg),
            lora=LoRASettings.from_config(model.lora, seed=m.seed),
        )
        return cls(**section_values(cfg, [f.name for f in fields(cls)], SECTIONS) | mapped)
