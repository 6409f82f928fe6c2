"""Checks of settings one at a time: every number finite (every integer within 64 bits), every count positive, every
choice (loggers and checkpoint contents too) among the valid ones, every dtype one this machine computes in at
speed."""

import contextlib
import math
from operator import attrgetter

from grpo_core.algos import (
    ADV_ESTIMATORS,
    FILTER_METRICS,
    KL_PENALTY_TYPES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_IS_LEVELS,
)
from grpo_core.checks.report import Report, invalid_choice
from grpo_core.config import hardware
from grpo_core.config.defaults import schema_default
from grpo_core.config.schema import CHECKPOINT_CONTENTS, DTYPE_SECTIONS, GRPOConfig, iter_settings

LOGGERS = ("console", "mlflow", "tensorboard", "wandb")
REGISTRIES = [
    ("algorithm.adv_estimator", ADV_ESTIMATORS),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", POLICY_LOSSES),
    ("algorithm.rollout_correction.rollout_is", (None, *ROLLOUT_IS_LEVELS)),
    ("algorithm.filter_groups.metric", FILTER_METRICS),
    ("actor_rollout_ref.actor.loss_agg_mode", LOSS_AGG_MODES),
    ("actor_rollout_ref.actor.kl_loss_type", KL_PENALTY_TYPES),
    ("algorithm.kl_penalty", KL_PENALTY_TYPES),
]
"""Settings whose valid values are the names the algorithms register, not a list in the schema."""


INT64 = (-(2**63), 2**63 - 1)
"""What torch, numpy and megatron hold an integer setting in: Python's integers have no bound, YAML's neither."""

COUNTS = (
    "trainer.total_training_steps",
    "data.val_batch_size",
    "actor_rollout_ref.nccl_timeout",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "evaluation.n",
    "evaluation.max_new_tokens",
    "evaluation.batch_size",
    "evaluation.limit",
    "launch.slurm_time_limit_min",
)
"""Counts (steps, sizes, seconds) that mean nothing at zero or below, each >= 1 or, where the schema allows it, null.
The batch sizes, epochs and layout are checked with the batches (layout.py); save_freq and test_freq take -1 (off)."""


def _numbers(value, key: str, nested: bool = False):
    """(dotted key, number) for every float and integer in a setting's value, through its dicts and lists, whose
    strings are numbers too: overrides stay strings until megatron or transformers reads them (``"nan"`` is NaN
    there)."""
    if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
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


def check_finite(cfg: GRPOConfig, r: Report) -> None:
    """Every float setting is a number. One rule for all: NaN fails every comparison, so each range check
    below would pass it (``lr=nan`` trained a run into NaN weights), and infinity passes most. Every integer fits
    in 64 bits (INT64)."""
    for key, _ in iter_settings():
        for where, value in _numbers(attrgetter(key)(cfg), key):
            if isinstance(value, float) and not math.isfinite(value):
                r.errors.append(f"{where}={value}: not a finite number (NaN and infinity are refused)")
            elif isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
                r.errors.append(f"{where}: an integer of {value.bit_length()} bits is out of range (64 at most)")


def check_counts(cfg: GRPOConfig, r: Report) -> None:
    """Counts of COUNTS: >= 1, or null where the schema's default is null."""
    for key in COUNTS:
        value = attrgetter(key)(cfg)
        if value is not None and value < 1:
            nullable = " (or null)" if schema_default(key) is None else ""
            r.errors.append(f"{key}={value} must be >= 1{nullable}")


def check_choices(cfg: GRPOConfig, r: Report) -> None:
    for key, f in iter_settings():
        choices = f.metadata.get("choices")
        if choices and attrgetter(key)(cfg) not in choices:
            r.errors.append(invalid_choice(key, attrgetter(key)(cfg), choices))
    for key, valid in REGISTRIES:
        if attrgetter(key)(cfg) not in valid:
            r.errors.append(invalid_choice(key, attrgetter(key)(cfg), valid))
    for name in cfg.trainer.logger:
        if name not in LOGGERS:
            r.errors.append(f"trainer.logger entry {name!r} is not valid; valid: {list(LOGGERS)}")


def check_precision(cfg: GRPOConfig, r: Report) -> None:
    """bf16 on a CPU without a bf16 matrix unit: torch's fallback multiplies ~25x slower than float32."""
    if cfg.trainer.device != "cpu" or hardware.cpu_has_bf16_matmul():
        return
    for key in DTYPE_SECTIONS:
        if attrgetter(key)(cfg).dtype == "bfloat16":
            r.warnings.append(
                f"{key}.dtype=bfloat16 on a CPU without bf16 matrix instructions (AVX-512 or AMX): its matrix products "
                "run ~25x slower than in float32; set float32, or auto (float32 here, bfloat16 where it is native)"
            )


def check_checkpoint_contents(cfg: GRPOConfig, r: Report) -> None:
    prefix, ckpt = "actor_rollout_ref.actor.checkpoint", cfg.actor_rollout_ref.actor.checkpoint
    for key in ("save_contents", "load_contents"):
        for name in getattr(ckpt, key) or []:
            if name not in CHECKPOINT_CONTENTS:
                r.errors.append(f"{prefix}.{key} entry {name!r} is not valid; valid: {list(CHECKPOINT_CONTENTS)}")
    if "model" not in ckpt.save_contents:
        r.notes.append(f"{prefix}.save_contents has no 'model': the model is saved anyway, so that a run can resume")
