"""Checks of the model's settings: the free-form overrides megatron-core and transformers read at start-up (their
keys checked now), and LoRA's numbers, targets and start adapter."""

import dataclasses
import difflib
import importlib.util
import warnings
from functools import cache
from operator import attrgetter
from pathlib import Path

from grpo_core.checks.report import Report
from grpo_core.config.schema import LORA_LINEARS, GRPOConfig
from grpo_core.models.fused import FUSIONS_NEEDING_KERNELS
from grpo_core.models.shape import HF_OVERRIDE_SECTION, ModelShape
from grpo_core.planning.budget import optimizer_offloaded

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


def check_megatron_overrides(cfg: GRPOConfig, r: Report) -> None:
    """override_transformer_config / override_optimizer_config go to megatron's TransformerConfig /
    OptimizerConfig: check their keys now, not at start-up."""
    for key, target in OVERRIDE_TARGETS:
        overrides = attrgetter(key)(cfg)
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


def check_model_overrides(cfg: GRPOConfig, r: Report) -> None:
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


def check_lora(cfg: GRPOConfig, shape: ModelShape | None, r: Report) -> None:
    """LoRA's numbers and names, and what it does not combine with."""
    lora, key = cfg.actor_rollout_ref.model.lora, "actor_rollout_ref.model.lora"
    if lora.rank < 0:
        r.errors.append(f"{key}.rank={lora.rank} must be >= 0 (0: LoRA off)")
    if lora.adapter_path is not None:
        _check_adapter(lora, key, cfg.actor_rollout_ref.model.path, r)
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


def _check_adapter(lora, key: str, base: str, r: Report) -> None:
    """A start adapter (``lora.adapter_path``) is a PEFT LoRA adapter of the run's rank and alpha whose files pass
    their checks (records/adapter.py: types, names, shapes, dtypes, finite values), and, where the base model
    (``base``) is a local directory, of its weights' shapes: what the ranks would fail on, in their logs."""
    from grpo_core.models.adapter import AdapterError, read_adapter, settings_mismatch

    if lora.rank <= 0:
        r.errors.append(f"{key}.adapter_path needs LoRA on: set {key}.rank to the adapter's rank")
        return
    base_dir = Path(base).expanduser()
    try:
        adapter = read_adapter(lora.adapter_path, base_dir if any(base_dir.glob("*.safetensors")) else None)
    except (AdapterError, OSError, ValueError) as e:
        r.errors.append(f"{key}.adapter_path: {e}")
        return
    if mismatch := settings_mismatch(adapter, lora.rank, lora.alpha):
        r.errors.append(f"{key}.adapter_path: {mismatch}; set {key}.rank and {key}.alpha to the adapter's")
