"""Checks of the parallel layout and the batches: sizes that split evenly over the ranks, token budgets that hold a
sequence, the reference and rollout engine on the actor's layout, the model's heads and positions."""

from grpo_core.checks.report import Report
from grpo_core.config.schema import GRPOConfig
from grpo_core.models.shape import ModelShape
from grpo_core.planning.batches import BATCH_KEYS
from grpo_core.planning.layout import ParallelLayout, pipeline_extra_layers, uneven_stages
from grpo_core.planning.planner import rollout_tp_fits

LAYOUT_KEYS = [
    ("tensor_model_parallel_size", "tensor model parallel size"),
    ("pipeline_model_parallel_size", "pipeline model parallel size"),
    ("virtual_pipeline_model_parallel_size", "virtual pipeline model parallel size"),
    ("context_parallel_size", "context parallel size"),
    ("expert_model_parallel_size", "expert model parallel size"),
    ("expert_tensor_parallel_size", "expert tensor parallel size"),
]


def check_batches(cfg: GRPOConfig, layout: ParallelLayout, r: Report) -> None:
    d, actor = cfg.data, cfg.actor_rollout_ref.actor
    n = cfg.actor_rollout_ref.rollout.n
    positives = [
        ("data.train_batch_size", d.train_batch_size),
        ("data.max_prompt_length", d.max_prompt_length),
        ("data.max_response_length", d.max_response_length),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
        ("trainer.total_epochs", cfg.trainer.total_epochs),
        ("trainer.nnodes", cfg.trainer.nnodes),
        ("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node),
    ]
    bad = [f"{key}={value} must be >= 1" for key, value in positives if value < 1]
    if bad:
        r.errors.extend(bad)
        return
    for key, value in [
        ("trainer.save_freq", cfg.trainer.save_freq),
        ("trainer.test_freq", cfg.trainer.test_freq),
    ]:
        if value == 0 or value < -1:
            r.errors.append(f"{key}={value} must be -1 (off) or >= 1")
    keep = cfg.trainer.max_actor_ckpt_to_keep
    if keep is not None and keep < 1:
        r.errors.append(f"trainer.max_actor_ckpt_to_keep={keep} must be >= 1 (or null: keep every checkpoint)")
    if bad_steps := [s for s in cfg.trainer.profile_steps if s < 1]:
        r.errors.append(f"trainer.profile_steps={cfg.trainer.profile_steps}: steps count from 1, not {bad_steps}")
    if d.train_batch_size % actor.ppo_mini_batch_size:
        r.errors.append(
            f"data.train_batch_size={d.train_batch_size} is not a multiple of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}"
        )
    responses = actor.ppo_mini_batch_size * n
    if responses % layout.dp:
        r.errors.append(
            f"a mini-batch of {actor.ppo_mini_batch_size} prompts x {n} responses = {responses} does not split "
            f"evenly over DP={layout.dp} ranks"
        )
        return
    per_rank = responses // layout.dp
    micro = actor.ppo_micro_batch_size_per_gpu
    if not actor.use_dynamic_bsz and per_rank % micro:
        r.errors.append(
            f"each DP rank gets {per_rank} responses per mini-batch, not a multiple of "
            f"ppo_micro_batch_size_per_gpu={micro}"
        )
    for name, (switch, budget, _) in BATCH_KEYS.items():
        section, key = getattr(cfg.actor_rollout_ref, name), f"actor_rollout_ref.{name}"
        if getattr(section, switch):
            _check_token_budget(cfg, layout, f"{key}.{switch}", f"{key}.{budget}", getattr(section, budget), r)


def _check_token_budget(cfg: GRPOConfig, layout: ParallelLayout, switch: str, key: str, budget: int, r: Report):
    """A token budget must hold one longest sequence. Pipeline stages need micro-batches of one shape: unpacked
    (context parallelism, or use_remove_padding=false) the budget sets a fixed number of rows (actor.rows_in_budget)."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if budget < longest:
        r.errors.append(
            f"{key}={budget} does not hold one sequence of max_prompt_length + max_response_length = {longest} tokens"
        )
    packed = cfg.actor_rollout_ref.model.use_remove_padding and layout.cp == 1
    if layout.pp > 1 and not packed:
        r.notes.append(
            f"{switch} with pipeline parallelism and unpacked rows: every micro-batch holds the same number of "
            f"whole-width rows, as many as {key}={budget} tokens hold"
        )


def check_layout(cfg: GRPOConfig, shape: ModelShape, layout: ParallelLayout, r: Report) -> None:
    actor_m = cfg.actor_rollout_ref.actor.megatron
    overrides = actor_m.override_transformer_config
    r.errors += layout.problems(shape, uneven_stages(overrides), pipeline_extra_layers(overrides))
    ref_m = cfg.actor_rollout_ref.ref.megatron
    for key, name in LAYOUT_KEYS:
        ref_value, actor_value = getattr(ref_m, key), getattr(actor_m, key)
        if ref_value is not None and ref_value != actor_value:
            r.errors.append(
                f"{name} mismatch: actor={actor_value}, ref={ref_value} "
                "(the reference model must share the actor's layout; leave ref's unset to inherit it)"
            )
    rollout = cfg.actor_rollout_ref.rollout
    rtp = rollout.tensor_model_parallel_size
    if rtp < 1 or layout.world_size % rtp:
        r.errors.append(f"rollout tensor parallel size {rtp} does not divide the world size {layout.world_size}")
    elif not rollout_tp_fits(shape, rtp):
        r.errors.append(
            f"rollout tensor parallel size {rtp} does not split {shape.num_attention_heads} attention heads "
            f"and {shape.num_kv_heads} KV heads: it must divide {shape.num_attention_heads} and divide "
            f"{shape.num_kv_heads} or be a multiple of it"
        )
    elif rtp > cfg.trainer.n_gpus_per_node:
        r.warnings.append(f"rollout TP={rtp} spans nodes: generation all-reduces will cross the network")
    if rollout.name in ("hf", "static") and rtp != 1:
        r.errors.append(
            f"rollout.name={rollout.name} generates on one device per rank: rollout TP must be 1, not {rtp}"
        )
    if rollout.name == "static":
        from grpo_core.rollout import static as static_engine  # torch and transformers: not for every config check

        if problem := static_engine.unsupported(shape):
            r.errors.append(problem)
    if rollout.name == "megatron":
        _check_megatron_rollout(cfg, layout, r)
    needs_ordering = cfg.trainer.device == "cuda" and (layout.tp > 1 or layout.cp > 1)
    if needs_ordering and cfg.trainer.env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        r.warnings.append(
            "trainer.env.CUDA_DEVICE_MAX_CONNECTIONS is not 1: megatron needs it to order tensor-parallel "
            "communication before the compute that waits for it"
        )
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    if total > shape.max_position_embeddings:
        r.errors.append(
            f"max_prompt_length + max_response_length = {total} exceeds the model's "
            f"max_position_embeddings {shape.max_position_embeddings}"
        )


def _check_megatron_rollout(cfg: GRPOConfig, layout: ParallelLayout, r: Report) -> None:
    """The megatron engine generates with the actor's own model through megatron's static inference path."""
    rollout, m = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor.megatron
    name = "rollout.name=megatron generates with the actor's model"
    if rollout.tensor_model_parallel_size != layout.tp:
        r.errors.append(f"{name}: rollout TP={rollout.tensor_model_parallel_size} must be the actor's TP={layout.tp}")
    if layout.pp != 1 or layout.vpp is not None:
        r.errors.append(f"{name}: it needs PP=1 without virtual stages, not PP={layout.pp} VPP={layout.vpp}")
    if layout.cp != 1:
        r.errors.append(f"{name}: it needs context parallel size 1, not {layout.cp}")
    if m.sequence_parallel and layout.tp > 1:
        r.errors.append(f"{name}: set actor_rollout_ref.actor.megatron.sequence_parallel=false (static inference)")
    if rollout.top_k != -1 and rollout.top_p < 1:
        r.errors.append("rollout.name=megatron samples with top_k or top_p, not both: set top_k=-1 or top_p=1.0")
    if rollout.dtype != m.dtype:
        r.warnings.append(f"rollout.dtype={rollout.dtype} is ignored: the megatron engine uses the actor's {m.dtype}")
