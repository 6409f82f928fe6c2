"""Cross-field checks of a resolved config: verl's GRPO + Megatron checklist, run before any GPU is used.

``check_config`` returns every error and warning at once, with the parallel layout and the per-GPU
memory estimate it computed on the way, so ``--dry-run`` can show them and the trainer can refuse to
start on the same rules. The checks live by domain beside this module; their order here is the order
in which problems are reported.
"""

from grpo_core.checks.algorithm import check_algorithm, check_custom_reward
from grpo_core.checks.launch import check_launch, check_paths, check_tracking
from grpo_core.checks.layout import check_batches, check_layout
from grpo_core.checks.memory import check_checkpoint_disk, check_memory
from grpo_core.checks.model import check_lora, check_megatron_overrides, check_model_overrides
from grpo_core.checks.records import check_records
from grpo_core.checks.report import Report
from grpo_core.checks.settings import (
    check_checkpoint_contents,
    check_choices,
    check_counts,
    check_finite,
    check_precision,
)
from grpo_core.config.schema import GRPOConfig
from grpo_core.models.shape import ModelShape
from grpo_core.planning.layout import actor_layout


def check_config(cfg: GRPOConfig, shape: ModelShape | None) -> Report:
    """Every problem with ``cfg``; shape-dependent checks are skipped when the model could not be read."""
    r = Report()
    check_finite(cfg, r)
    check_counts(cfg, r)
    if r.errors:  # the other checks compute with these numbers
        return r
    check_choices(cfg, r)
    check_precision(cfg, r)
    check_checkpoint_contents(cfg, r)
    check_algorithm(cfg, r)
    check_paths(cfg, r)
    check_megatron_overrides(cfg, r)
    check_model_overrides(cfg, r)
    check_custom_reward(cfg, r)
    check_lora(cfg, shape, r)
    check_records(cfg, r)
    check_launch(cfg, r)
    check_tracking(cfg, r)
    layout = actor_layout(cfg)
    check_batches(cfg, layout, r)
    if shape is not None:
        check_checkpoint_disk(cfg, shape, r)
    if shape is not None and cfg.trainer.nnodes >= 1 and cfg.trainer.n_gpus_per_node >= 1:
        n_layout_errors = len(r.errors)
        check_layout(cfg, shape, layout, r)
        if len(r.errors) == n_layout_errors:
            r.layout = layout
            check_memory(cfg, shape, layout, r)
    return r
