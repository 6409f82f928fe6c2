"""Cross-field checks of a resolved config: verl's GRPO + Megatron checklist, run before any GPU is used.

``check_config`` returns every error and warning at once, with the parallel layout and the per-GPU
memory estimate it computed on the way, so ``--dry-run`` can show them and the trainer can refuse to
start on the same rules.
"""

import contextlib
import dataclasses
import difflib
import importlib.util
import math
import re
import shutil
import warnings
from dataclasses import dataclass, field
from functools import cache
from operator import attrgetter
from pathlib import Path

from grpo_core.algos import (
    ADV_ESTIMATORS,
    BYPASS_LOSS_TYPES,
    FILTER_METRICS,
    KL_PENALTY_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_IS_LEVELS,
    parse_is_threshold,
    parse_rs,
)
from grpo_core.config.schema import CHECKPOINT_CONTENTS, DTYPE_SECTIONS, LORA_LINEARS, GRPOConfig, iter_settings
from grpo_core.config.verl_keys import REFUSED_VALUES
from grpo_core.models.shape import HF_OVERRIDE_SECTION, ModelShape
from grpo_core.planning import hardware
from grpo_core.planning.batches import BATCH_KEYS, batch_settings
from grpo_core.planning.budget import (
    estimate_memory,
    fitting_batches,
    gpu_memory_gib,
    local_host_memory_gib,
    memory_options,
    optimizer_offloaded,
)
from grpo_core.planning.layout import ParallelLayout, actor_layout, pipeline_extra_layers, uneven_stages
from grpo_core.planning.memory import DTYPE_BYTES, MemoryEstimate, trained_params_per_gpu
from grpo_core.planning.planner import PEAK_SHARE, rollout_tp_fits
from grpo_core.rewards.custom import RewardFileError, load_custom_reward

LOGGERS = ("console", "mlflow", "tensorboard", "wandb")
LAYOUT_KEYS = [
    ("tensor_model_parallel_size", "tensor model parallel size"),
    ("pipeline_model_parallel_size", "pipeline model parallel size"),
    ("virtual_pipeline_model_parallel_size", "virtual pipeline model parallel size"),
    ("context_parallel_size", "context parallel size"),
    ("expert_model_parallel_size", "expert model parallel size"),
    ("expert_tensor_parallel_size", "expert tensor parallel size"),
]


FUSIONS_NEEDING_KERNELS = {"bias_dropout_fusion": ("transformer_engine", "apex")}
"""Kernel-fusion flags that megatron refuses at start-up without one of these packages (RoPE, SwiGLU and
gradient-accumulation fusion are on by default on GPUs, served by torch: models/fused.py)."""


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how verl keys given are taken here (no effect, or a different one)
    layout: ParallelLayout | None = None
    memory: MemoryEstimate | None = None


def _get(cfg: object, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _invalid_choice(key: str, value, valid) -> str:
    """One line; a value that selects one of verl's features not offered here names that feature."""
    feature = REFUSED_VALUES.get((key, value))
    if feature is not None:
        return f"{key}={value}: not offered here: {feature}; valid: {list(valid)}"
    return f"{key}={value!r} is not valid; valid: {list(valid)}"


def _numbers(value, key: str, nested: bool = False):
    """(dotted key, float) for every float in a setting's value, through its dicts and lists, whose strings are
    numbers too: overrides stay strings until megatron or transformers reads them (``"nan"`` is NaN there)."""
    if isinstance(value, float):
        yield key, value
    elif isinstance(value, str) and nested:
        with contextlib.suppress(ValueError):
            yield key, float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{key}.{k}", True)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{key}[{i}]", True)


def _check_finite(cfg: GRPOConfig, r: Report) -> None:
    """Every float setting is a number. One rule for all: NaN fails every comparison, so each range check
    below would pass it (``lr=nan`` trained a run into NaN weights), and infinity passes most."""
    for key, _ in iter_settings():
        for where, value in _numbers(_get(cfg, key), key):
            if not math.isfinite(value):
                r.errors.append(f"{where}={value}: not a finite number (NaN and infinity are refused)")


def _check_choices(cfg: GRPOConfig, r: Report) -> None:
    for key, f in iter_settings():
        choices = f.metadata.get("choices")
        if choices and _get(cfg, key) not in choices:
            r.errors.append(_invalid_choice(key, _get(cfg, key), choices))
    registries = [
        ("algorithm.adv_estimator", ADV_ESTIMATORS),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", POLICY_LOSSES),
        ("algorithm.rollout_correction.rollout_is", (None, *ROLLOUT_IS_LEVELS)),
        ("algorithm.filter_groups.metric", FILTER_METRICS),
        ("actor_rollout_ref.actor.loss_agg_mode", LOSS_AGG_MODES),
        ("actor_rollout_ref.actor.kl_loss_type", KL_PENALTY_TYPES),
        ("algorithm.kl_penalty", KL_PENALTY_TYPES),
    ]
    for key, valid in registries:
        if _get(cfg, key) not in valid:
            r.errors.append(_invalid_choice(key, _get(cfg, key), valid))
    for name in cfg.trainer.logger:
        if name not in LOGGERS:
            r.errors.append(f"trainer.logger entry {name!r} is not valid; valid: {list(LOGGERS)}")


def _check_checkpoint_contents(cfg: GRPOConfig, r: Report) -> None:
    prefix, ckpt = "actor_rollout_ref.actor.checkpoint", cfg.actor_rollout_ref.actor.checkpoint
    for key in ("save_contents", "load_contents"):
        for name in getattr(ckpt, key) or []:
            if name not in CHECKPOINT_CONTENTS:
                r.errors.append(f"{prefix}.{key} entry {name!r} is not valid; valid: {list(CHECKPOINT_CONTENTS)}")
    if "model" not in ckpt.save_contents:
        r.notes.append(f"{prefix}.save_contents has no 'model': the model is saved anyway, so that a run can resume")


def _check_algorithm(cfg: GRPOConfig, r: Report) -> None:
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    n = cfg.actor_rollout_ref.rollout.n
    if n < 2:
        r.errors.append(
            f"actor_rollout_ref.rollout.n (algorithm.group_size)={n}: GRPO compares responses within a "
            "group, so it needs at least 2 per prompt"
        )
    elif not 5 <= n <= 10:
        r.warnings.append(
            f"group size {n} is outside the guide's 5-10: fewer gives noisy baselines, more costs generation"
        )
    if actor.kl_loss_coef < 0:
        r.errors.append(f"actor_rollout_ref.actor.kl_loss_coef={actor.kl_loss_coef} must be >= 0")
    if actor.use_kl_loss and actor.kl_loss_coef == 0:
        r.warnings.append("use_kl_loss=true with kl_loss_coef=0 computes reference log-probs for nothing")
    if actor.use_kl_loss and algo.use_kl_in_reward:
        r.warnings.append("KL is both a loss (use_kl_loss) and a reward penalty (use_kl_in_reward): counted twice")
    if actor.clip_ratio <= 0:
        r.errors.append(f"actor_rollout_ref.actor.clip_ratio={actor.clip_ratio} must be > 0")
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(actor, key)
        if value is not None and value < 0:
            r.errors.append(f"actor_rollout_ref.actor.{key}={value} must be >= 0")
    if actor.loss_scale_factor is not None and actor.loss_scale_factor <= 0:
        r.errors.append(f"actor_rollout_ref.actor.loss_scale_factor={actor.loss_scale_factor} must be > 0 (or null)")
    if actor.clip_ratio_c <= 1:
        r.errors.append(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c} must be > 1 (dual clip)")
    if actor.optim.lr <= 0:
        r.errors.append(f"actor_rollout_ref.actor.optim.lr={actor.optim.lr} must be > 0")
    if not 0 <= actor.optim.lr_warmup_steps_ratio < 1:
        r.errors.append("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio must be in [0, 1)")
    if cfg.actor_rollout_ref.rollout.mode == "async":
        r.notes.append(
            "actor_rollout_ref.rollout.mode=async: the engine is colocated with the actor and generates between "
            "training phases, as verl's hybrid engine does in either mode"
        )
    _check_overlong_buffer(cfg, r)
    _check_filter_groups(cfg, r)
    _check_estimator_and_loss(cfg, r)
    if cfg.reward_model.enable:
        r.errors.append("reward_model.enable=true: learned reward models are not supported; rule rewards only")
    if not cfg.actor_rollout_ref.hybrid_engine:
        r.errors.append(
            "actor_rollout_ref.hybrid_engine=false: the actor, reference and rollout engine always share their GPUs "
            "here (verl's GRPO trainer also requires true); separate rollout GPUs are not offered"
        )


SEQUENCE_LOSSES = {"gspo": "GSPO's objective", "sapo": "SAPO's objective (verl always)", "geo_mean": "GMPO"}
"""Losses whose objective is a mean over sequences: with another loss_agg_mode they train, but not as published."""


def _check_estimator_and_loss(cfg: GRPOConfig, r: Report) -> None:
    """The GRPO family's options: discounting only where an estimator discounts, GSPO with its aggregation,
    rollout importance weights with a positive bound."""
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    if algo.lam != 1.0:
        r.notes.append(
            f"algorithm.lam={algo.lam}: no effect here: GAE's lambda, and no estimator offered here uses GAE"
        )
    if algo.gamma != 1.0 and algo.adv_estimator != "reinforce_plus_plus":
        r.notes.append(
            f"algorithm.gamma={algo.gamma}: no effect with adv_estimator={algo.adv_estimator} "
            "(only reinforce_plus_plus discounts its returns)"
        )
    if not 0 <= algo.gamma <= 1:
        r.errors.append(f"algorithm.gamma={algo.gamma} must be in [0, 1]")
    mode, loss = actor.loss_agg_mode, actor.policy_loss
    if loss.loss_mode in SEQUENCE_LOSSES and mode != "seq-mean-token-mean":
        r.warnings.append(
            f"policy_loss.loss_mode={loss.loss_mode} with loss_agg_mode={mode}: {SEQUENCE_LOSSES[loss.loss_mode]} "
            "averages each sequence's tokens then the sequences; set "
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"
        )
    prefix = "actor_rollout_ref.actor.policy_loss"
    if loss.loss_mode == "dro" and (loss.dro_beta is None or loss.dro_beta <= 0):
        r.errors.append(f"{prefix}.dro_beta={loss.dro_beta}: loss_mode=dro needs a beta > 0 (verl has no default)")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        if getattr(loss, key) <= 0:
            r.errors.append(f"{prefix}.{key}={getattr(loss, key)} must be > 0")
    if loss.clip_cov_lb >= loss.clip_cov_ub:
        r.errors.append(f"{prefix}.clip_cov_lb={loss.clip_cov_lb} must be < clip_cov_ub={loss.clip_cov_ub}")
    for key in ("tau_pos", "tau_neg"):
        if getattr(actor, key) <= 0:
            r.errors.append(f"actor_rollout_ref.actor.{key}={getattr(actor, key)} must be > 0 (SAPO's temperature)")
    _check_rollout_correction(cfg, r)


def _check_rollout_correction(cfg: GRPOConfig, r: Report) -> None:
    """verl's threshold syntaxes parse, rejection sampling has thresholds, bypass mode has a known loss type; and
    the settings that do nothing as given are said to."""
    rc, prefix = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    try:
        parse_is_threshold(rc.rollout_is_threshold)
    except ValueError as e:
        r.errors.append(f"{prefix}.{e}")
    if rc.rollout_rs is not None:
        try:
            parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as e:
            r.errors.append(f"{prefix}.{e}")
    if rc.loss_type not in BYPASS_LOSS_TYPES:
        r.errors.append(_invalid_choice(f"{prefix}.loss_type", rc.loss_type, BYPASS_LOSS_TYPES))
    if loss_mode == "bypass_mode" and not rc.bypass_mode:
        r.errors.append(
            "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode: set algorithm.rollout_correction.bypass_mode="
            "true instead (it makes the engine's log-probs the old policy's, which this loss assumes)"
        )
    if rc.bypass_mode and loss_mode not in ("vanilla", "bypass_mode"):
        r.errors.append(
            f"{prefix}.bypass_mode=true replaces policy_loss.loss_mode with bypass_mode (its loss_type chooses PPO's "
            f"clip or REINFORCE); loss_mode={loss_mode} would be ignored: leave it vanilla"
        )
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        r.notes.append(f"{prefix}.rollout_is_batch_normalize: no effect without rollout_is")
    if rc.bypass_mode and rc.loss_type == "ppo_clip" and rc.rollout_is is not None:
        r.notes.append(
            f"{prefix}.rollout_is={rc.rollout_is} with bypass_mode and loss_type=ppo_clip: no weights are applied "
            "(PPO's ratio is already pi / pi_rollout; verl does the same)"
        )


def _check_filter_groups(cfg: GRPOConfig, r: Report) -> None:
    """Dynamic sampling filters on a value the reward produces, with a non-negative budget of batches."""
    fg, prefix = cfg.algorithm.filter_groups, "algorithm.filter_groups"
    if not fg.enable:
        return
    if fg.max_num_gen_batches < 0:
        r.errors.append(f"{prefix}.max_num_gen_batches={fg.max_num_gen_batches} must be >= 0 (0: no limit)")
    if fg.metric == "acc" and cfg.custom_reward_function.path:
        r.errors.append(
            f"{prefix}.metric=acc needs a reward that reports accuracy (the built-in ones do: full score or not); "
            "custom_reward_function's reward is its score alone: set filter_groups.metric=score"
        )
    rm = cfg.reward_model
    shaped = rm.reward_manager == "dapo" and rm.reward_kwargs.overlong_buffer_cfg.enable
    if fg.metric == "seq_final_reward" and not shaped:
        r.notes.append(f"{prefix}.metric=seq_final_reward: no shaping is on, so it is the score (as metric=score)")


def _check_overlong_buffer(cfg: GRPOConfig, r: Report) -> None:
    rm = cfg.reward_model
    kwargs, buffer = rm.reward_kwargs, rm.reward_kwargs.overlong_buffer_cfg
    prefix = "reward_model.reward_kwargs"
    if not buffer.enable:
        return
    if rm.reward_manager != "dapo":
        r.warnings.append(
            f"{prefix}.overlong_buffer_cfg.enable=true does nothing with reward_manager={rm.reward_manager}"
        )
        return
    if kwargs.max_resp_len is None:
        r.errors.append(f"{prefix}.overlong_buffer_cfg.enable=true needs {prefix}.max_resp_len")
    elif not 0 < buffer.len <= kwargs.max_resp_len:
        r.errors.append(
            f"{prefix}.overlong_buffer_cfg.len={buffer.len} must be in (0, max_resp_len={kwargs.max_resp_len}]"
        )
    elif kwargs.max_resp_len - buffer.len >= cfg.data.max_response_length:
        r.warnings.append(
            f"no response is penalised: max_resp_len - overlong_buffer_cfg.len = {kwargs.max_resp_len - buffer.len} "
            f"tokens is not below data.max_response_length={cfg.data.max_response_length}"
        )


def _check_batches(cfg: GRPOConfig, layout: ParallelLayout, r: Report) -> None:
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


def _check_layout(cfg: GRPOConfig, shape: ModelShape, layout: ParallelLayout, r: Report) -> None:
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


def _check_precision(cfg: GRPOConfig, r: Report) -> None:
    """bf16 on a CPU without a bf16 matrix unit: torch's fallback multiplies ~25x slower than float32."""
    if cfg.trainer.device != "cpu" or hardware.cpu_has_bf16_matmul():
        return
    for key in DTYPE_SECTIONS:
        if attrgetter(key)(cfg).dtype == "bfloat16":
            r.warnings.append(
                f"{key}.dtype=bfloat16 on a CPU without bf16 matrix instructions (AVX-512 or AMX): its matrix products "
                "run ~25x slower than in float32; set float32, or auto (float32 here, bfloat16 where it is native)"
            )


def _batch_remedy(cfg: GRPOConfig, shape: ModelShape, phase: str) -> str:
    """The values that fit, where smaller micro-batches are enough; else the settings to lower (the generation
    phase has none: its share is rollout.gpu_memory_utilization)."""
    if fits := fitting_batches(cfg, shape):
        return "set " + " ".join(f"{key}={value}" for key, value in fits.items()) + " (estimated to fit), "
    now = ", ".join(f"{s.key} (now {s.value})" for s in batch_settings(cfg, phase))
    return f"lower {now}, " if now else ""


def _check_memory(cfg: GRPOConfig, shape: ModelShape, layout: ParallelLayout, r: Report) -> None:
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


ADAM_CHECKPOINT_BYTES = 12  # per parameter: fp32 master copy and both Adam moments, whatever the format


def _free_gb(directory: str) -> float | None:
    """Free space where ``directory`` is or will be created (its nearest existing parent)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free / 1e9
    except OSError:
        return None


def _check_checkpoint_disk(cfg: GRPOConfig, shape: ModelShape, r: Report) -> None:
    """A save that cannot fit fails at the end of a run (its partial directory removed): say so before the start.
    Only where the run would write (a GPU run's dry run on a laptop says nothing about the cluster's disks)."""
    import torch

    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        return
    where = cfg.trainer.default_local_dir or "."
    if (free := _free_gb(where)) is None:
        return
    actor, keep = cfg.actor_rollout_ref.actor, cfg.trainer.max_actor_ckpt_to_keep
    # the whole model's parameters, or a LoRA run's adapters (its frozen base stays model.path's)
    saved = trained_params_per_gpu(shape, ParallelLayout(world_size=1), cfg.actor_rollout_ref.model.lora.rank)
    one = weights = saved * DTYPE_BYTES[actor.megatron.dtype] / 1e9
    if "hf_model" in actor.checkpoint.save_contents:  # the weights again, as Hugging Face files
        one += weights
    lean = ""
    if "optimizer" in actor.checkpoint.save_contents:
        one += saved * ADAM_CHECKPOINT_BYTES / 1e9
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


OVERRIDE_TARGETS = [
    (
        "actor_rollout_ref.actor.megatron.override_transformer_config",
        "transformer.transformer_config.TransformerConfig",
    ),
    ("actor_rollout_ref.ref.megatron.override_transformer_config", "transformer.transformer_config.TransformerConfig"),
    ("actor_rollout_ref.actor.optim.override_optimizer_config", "optimizer.optimizer_config.OptimizerConfig"),
]
"""Free-form settings and the megatron-core dataclass (under ``megatron.core``) whose fields they set."""


@cache
def _megatron_fields(target: str) -> frozenset[str] | None:
    """The field names of a megatron-core config dataclass, or None where megatron-core is not importable."""
    module, name = target.rsplit(".", 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls = getattr(importlib.import_module(f"megatron.core.{module}"), name)
    except ImportError:
        return None
    return frozenset(f.name for f in dataclasses.fields(cls))


def _check_megatron_overrides(cfg: GRPOConfig, r: Report) -> None:
    """override_transformer_config / override_optimizer_config go to megatron's TransformerConfig /
    OptimizerConfig: check their keys now, not at start-up."""
    for key, target in OVERRIDE_TARGETS:
        overrides = _get(cfg, key)
        if not overrides:
            continue
        known, cls = _megatron_fields(target), target.rsplit(".", 1)[1]
        if known is None:
            r.warnings.append(f"megatron-core is not importable here: {key} keys were not checked against {cls}")
            continue
        for name, value in overrides.items():
            prefix = f"{key}.{name}"
            if name not in known:
                guess = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean '{guess[0]}'?" if guess else ""
                r.errors.append(f"{prefix}: megatron's {cls} has no field '{name}'{hint}")
            elif value is True and name in FUSIONS_NEEDING_KERNELS:
                needs = FUSIONS_NEEDING_KERNELS[name]
                if not any(importlib.util.find_spec(m) for m in needs):
                    r.warnings.append(
                        f"{prefix}=true needs {' or '.join(needs)}, not installed here; megatron refuses it at start-up"
                    )
    actor = cfg.actor_rollout_ref.actor
    if actor.megatron.optimizer_offload and optimizer_offloaded(cfg) < 1.0:
        r.warnings.append(
            "actor_rollout_ref.actor.megatron.optimizer_offload=true is overridden by "
            "actor_rollout_ref.actor.optim.override_optimizer_config (optimizer_cpu_offload / "
            "optimizer_offload_fraction): the optimizer states are not all in host memory"
        )
    if actor.optim.override_optimizer_config.get("use_precision_aware_optimizer") and not importlib.util.find_spec(
        "transformer_engine"
    ):
        r.warnings.append(
            "override_optimizer_config.use_precision_aware_optimizer=true needs Transformer Engine >= 2.1, not "
            "installed here: megatron's OptimizerConfig fails at start-up without it"
        )


def _check_model_overrides(cfg: GRPOConfig, r: Report) -> None:
    """verl's Megatron nesting: Hugging Face fields under override_config.model_config, nothing else here."""
    overrides = cfg.actor_rollout_ref.model.override_config
    prefix = "actor_rollout_ref.model.override_config"
    if unsupported := sorted(set(overrides) - {HF_OVERRIDE_SECTION}):
        r.errors.append(
            f"{prefix}: {', '.join(unsupported)} not supported; only {prefix}.{HF_OVERRIDE_SECTION}.<Hugging Face "
            f"config field> is (e.g. +{prefix}.{HF_OVERRIDE_SECTION}.max_position_embeddings=10240)"
        )
    fields = overrides.get(HF_OVERRIDE_SECTION)
    if fields is not None and not isinstance(fields, dict):
        r.errors.append(f"{prefix}.{HF_OVERRIDE_SECTION}={fields!r} must be a mapping of config fields to values")


def _check_custom_reward(cfg: GRPOConfig, r: Report) -> None:
    """Import the user's reward file now: a typo must not wait for the first scored rollout."""
    custom = cfg.custom_reward_function
    if not custom.path:
        return
    try:
        load_custom_reward(custom.path, custom.name)
    except RewardFileError as e:
        r.errors.append(str(e))


def _not_a_directory(path: str) -> Path | None:
    """The existing file at ``path`` or above it, which keeps ``path`` from being (made) a directory."""
    for where in (Path(path), *Path(path).parents):
        if where.exists():
            return None if where.is_dir() else where
    return None


MISSING_DATA = "data file {} does not exist yet (write it with `grpo prepare`)"
"""A warning for ``grpo train``; ``grpo pipeline`` leaves it out, as it writes the data itself."""


def _check_paths(cfg: GRPOConfig, r: Report) -> None:
    run_dir = cfg.trainer.default_local_dir
    if (blocker := _not_a_directory(run_dir)) is not None:
        r.errors.append(
            f"trainer.default_local_dir={run_dir}: {blocker} is a file, not a directory; point it at a directory "
            "for the run's checkpoints, logs and metrics"
        )
    for path in cfg.data.train_files + cfg.data.val_files:
        if not Path(path).exists():
            r.warnings.append(MISSING_DATA.format(path))
    mode = cfg.trainer.resume_mode
    if mode not in ("auto", "disable") and not Path(mode).exists():
        r.errors.append(f"trainer.resume_mode={mode!r}: not 'auto', 'disable' or an existing checkpoint path")


ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
"""HOST:PORT, the host a name, an IPv4 address or a bracketed IPv6 address."""


def missing_rendezvous(cfg: GRPOConfig) -> str | None:
    """Why this config cannot start a multi-node torchrun job here, or None. A dry run only warns about it (a
    config file or `grpo plan` describes the cluster, not the address of its node 0); `grpo train` refuses."""
    nnodes = cfg.trainer.nnodes
    if nnodes > 1 and cfg.launch.launcher == "torchrun" and cfg.launch.rdzv_endpoint is None:
        return (
            f"trainer.nnodes={nnodes} with launch.launcher=torchrun needs launch.rdzv_endpoint=HOST:PORT (an address "
            "of node 0 that every node reaches) and launch.node_rank on each node; or use launch.launcher=slurm"
        )
    return None


def _check_launch(cfg: GRPOConfig, r: Report) -> None:
    """How the ranks are started: the rendezvous address and this node's rank."""
    launch, nnodes = cfg.launch, cfg.trainer.nnodes
    endpoint = launch.rdzv_endpoint
    if endpoint is not None and not ((m := ENDPOINT.fullmatch(endpoint)) and 0 < int(m.group(2)) < 65536):
        r.errors.append(f"launch.rdzv_endpoint={endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
    if problem := missing_rendezvous(cfg):
        r.warnings.append(problem)
    if nnodes >= 1 and not 0 <= launch.node_rank < nnodes:
        r.errors.append(f"launch.node_rank={launch.node_rank} must be in [0, trainer.nnodes={nnodes})")
    for key in ("stuck_timeout_s", "timeout_s"):
        value = getattr(launch, key)
        if value is not None and value <= 0:
            r.errors.append(f"launch.{key}={value} must be > 0 (or null: no limit)")
    if launch.stop_grace_s < 0:
        r.errors.append(f"launch.stop_grace_s={launch.stop_grace_s} must be >= 0")
    if (hang := cfg.trainer.hang_timeout_s) is not None and hang <= 0:
        r.errors.append(f"trainer.hang_timeout_s={hang} must be > 0 (or null: automatic)")


def _check_lora(cfg: GRPOConfig, shape: ModelShape | None, r: Report) -> None:
    """LoRA's numbers and names, and what it does not combine with."""
    lora, key = cfg.actor_rollout_ref.model.lora, "actor_rollout_ref.model.lora"
    if lora.rank < 0:
        r.errors.append(f"{key}.rank={lora.rank} must be >= 0 (0: LoRA off)")
    if lora.adapter_path is not None:
        _check_adapter(lora, key, r)
    if lora.rank <= 0:
        return
    if lora.alpha <= 0:
        r.errors.append(f"{key}.alpha={lora.alpha} must be > 0")
    if not 0 <= lora.dropout < 1:
        r.errors.append(f"{key}.dropout={lora.dropout} must be in [0, 1)")
    for name in ("target_modules", "exclude_modules"):
        for entry in getattr(lora, name):
            if entry not in (*LORA_LINEARS, "all-linear") and not any(c in entry for c in "*?[."):
                valid = [*LORA_LINEARS, "all-linear", "or a wildcard pattern on module names"]
                r.errors.append(f"{key}.{name} entry {entry!r} is not a LoRA target; valid: {valid}")
    if not lora.target_modules and not lora.exclude_modules:
        r.errors.append(f"{key}.target_modules is empty: no linear would get an adapter")
    m = cfg.actor_rollout_ref.actor.megatron
    if shape is not None and shape.is_moe and (m.expert_tensor_parallel_size or m.tensor_model_parallel_size) > 1:
        r.errors.append(
            f"{key}: LoRA on experts split over expert tensor parallelism is not offered here; set "
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"
        )


def _check_adapter(lora, key: str, r: Report) -> None:
    """A start adapter (``lora.adapter_path``) is a readable PEFT LoRA adapter of the run's rank and alpha."""
    from grpo_core.models.adapter import AdapterError, read_adapter, settings_mismatch

    if lora.rank <= 0:
        r.errors.append(f"{key}.adapter_path needs LoRA on: set {key}.rank to the adapter's rank")
        return
    try:
        adapter = read_adapter(lora.adapter_path)
    except (AdapterError, OSError, ValueError, KeyError) as e:
        r.errors.append(f"{key}.adapter_path: {e}")
        return
    if mismatch := settings_mismatch(adapter, lora.rank, lora.alpha):
        r.errors.append(f"{key}.adapter_path: {mismatch}; set {key}.rank and {key}.alpha to the adapter's")


def check_config(cfg: GRPOConfig, shape: ModelShape | None) -> Report:
    """Every problem with ``cfg``; shape-dependent checks are skipped when the model could not be read."""
    r = Report()
    _check_finite(cfg, r)
    if r.errors:  # the other checks compute with these numbers
        return r
    _check_choices(cfg, r)
    _check_precision(cfg, r)
    _check_checkpoint_contents(cfg, r)
    _check_algorithm(cfg, r)
    _check_paths(cfg, r)
    _check_megatron_overrides(cfg, r)
    _check_model_overrides(cfg, r)
    _check_custom_reward(cfg, r)
    _check_lora(cfg, shape, r)
    _check_launch(cfg, r)
    if not 0 < cfg.tracking.champion_alpha <= 1:
        r.errors.append(f"tracking.champion_alpha={cfg.tracking.champion_alpha} must be in (0, 1]")
    from grpo_core.tracking.notify import target_problems  # (a leaf module: no import of the tracking package's)

    r.errors += target_problems(cfg.tracking.notify_webhook_url, cfg.tracking.notify_block)
    for key in ("train_retries", "train_retry_delay_s"):
        if (value := getattr(cfg.tracking, key)) < 0:
            r.errors.append(f"tracking.{key}={value} must be >= 0")
    layout = actor_layout(cfg)
    _check_batches(cfg, layout, r)
    if shape is not None:
        _check_checkpoint_disk(cfg, shape, r)
    if shape is not None and cfg.trainer.nnodes >= 1 and cfg.trainer.n_gpus_per_node >= 1:
        n_layout_errors = len(r.errors)
        _check_layout(cfg, shape, layout, r)
        if len(r.errors) == n_layout_errors:
            r.layout = layout
            _check_memory(cfg, shape, layout, r)
    return r
