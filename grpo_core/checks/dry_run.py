"""Resolve a run's config and say, before any process group or GPU exists, whether it is consistent
and will fit: the resolved tree, the parallel layout and the per-GPU memory by phase."""

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from grpo_core.checks.report import Report
from grpo_core.checks.validate import check_config
from grpo_core.config import GRPOConfig, to_yaml
from grpo_core.config.load import load_config_with_notes
from grpo_core.models.shape import (
    ModelShape,
    ModelShapeError,
    hf_overrides,
    read_hf_config,
    unknown_override_fields,
    with_overrides,
)
from grpo_core.planning.batches import update_micro_batch
from grpo_core.planning.budget import gpu_memory_gib, memory_options, optimizer_offloaded
from grpo_core.tracking.mlflow_run import tracking_uri
from grpo_core.tracking.registry import RegistryModel, adapter_base, fetch_model, is_model_uri


@dataclass
class ResolvedRun:
    config: GRPOConfig
    shape: ModelShape | None
    report: Report
    start_model: RegistryModel | None = None  # model.path was a models:/ URI: the version it resolved to
    lora_base: str | None = None  # with LoRA: the base its adapters belong to, as a registry version records it

    def pinned(self, overrides: list[str]) -> list[str]:
        """``overrides`` for the processes started after this (ranks, the pipeline's tasks): a registry model
        path replaced by its local copy (an adapter's: its base's, and the adapter as the adapters' start), so none
        resolves the URI again (an alias may move meanwhile)."""
        if self.start_model is None:
            return list(overrides)
        model = self.config.actor_rollout_ref.model
        pinned = [*overrides, f"actor_rollout_ref.model.path={model.path}"]
        if self.start_model.is_adapter:
            pinned.append(f"actor_rollout_ref.model.lora.adapter_path={model.lora.adapter_path}")
        return pinned


def resolve_run(config_path: str | Path | None, overrides: list[str]) -> ResolvedRun:
    """Load, fetch a registry model (``models:/NAME@ALIAS``), read the model's shape and check everything.
    Raises ConfigError only for unreadable input, RegistryError/RegistryUnreachable for a registry model that
    cannot be had; consistency problems come back in ``report.errors``."""
    cfg, notes = load_config_with_notes(config_path, overrides)
    model = cfg.actor_rollout_ref.model
    start_model, lora_base, adapter_error = None, model.path if model.lora.rank > 0 else None, None
    if is_model_uri(model.path):
        start_model = fetch_model(model.path, tracking_uri(cfg), cfg.tracking.model_cache_dir)
        model.path, lora_base = str(start_model.path), start_model.canonical if lora_base else None
        notes.append(f"actor_rollout_ref.model.path: {start_model.describe()}")
        if start_model.is_adapter:  # its base's weights, and the adapters start from it
            lora_base, model.path = adapter_base(start_model, tracking_uri(cfg), cfg.tracking.model_cache_dir)
            notes.append(f"actor_rollout_ref.model.path: a LoRA adapter on {lora_base}: its base ({model.path}) "
                         "with the adapters starting from it")  # fmt: skip
            if model.lora.rank > 0:
                model.lora.adapter_path = str(start_model.path)
            else:
                adapter_error = (
                    f"actor_rollout_ref.model.path: {start_model.canonical} is a LoRA adapter; a run from it trains "
                    "the adapter: set actor_rollout_ref.model.lora.rank and alpha to the adapter's"
                )
    shape, shape_error, unknown = None, None, []
    hf_fields = hf_overrides(model.override_config)
    try:
        hf_config = read_hf_config(model.path)
        shape = ModelShape.from_hf_config(with_overrides(hf_config, hf_fields))
        unknown = unknown_override_fields(hf_config, hf_fields)
    except ModelShapeError as e:
        shape_error = f"actor_rollout_ref.model.path: {e}"
    report = check_config(cfg, shape)
    report.notes[:0] = notes
    if shape_error:
        report.errors.insert(0, shape_error)
    if adapter_error:
        report.errors.insert(0, adapter_error)
    prefix = "actor_rollout_ref.model.override_config.model_config"
    report.warnings += [
        f"{prefix}.{key}: the model's config.json has no such field and transformers' config class does not know "
        "it either (a typo?); it is passed on as given"
        for key in unknown
    ]
    return ResolvedRun(cfg, shape, report, start_model, lora_base)


def render_dry_run(run: ResolvedRun, console: Console) -> None:
    cfg, report = run.config, run.report
    console.rule("resolved config")
    console.print(to_yaml(cfg), markup=False, highlight=False)
    if run.shape is not None:
        s = run.shape
        console.print(
            f"model: {cfg.actor_rollout_ref.model.path} ({s.model_type}, {s.num_params / 1e9:.2f}B params, "
            f"{s.num_layers} layers, {s.num_attention_heads} heads / {s.num_kv_heads} KV"
            + (f", {s.num_experts} experts top-{s.experts_per_token}" if s.is_moe else "")
            + ")",
            markup=False,
        )
    if report.layout is not None:
        console.print(f"parallel layout: {report.layout.describe()}", markup=False)
    if report.memory is not None:
        console.print(_memory_table(run))
    print_notes_and_warnings(report, console)


def print_notes_and_warnings(report: Report, console: Console) -> None:
    for note in report.notes:
        console.print(f"note: {note}", style="dim", markup=False, highlight=False, soft_wrap=True)
    for warning in report.warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False, soft_wrap=True)


def _memory_table(run: ResolvedRun) -> Table:
    cfg, m = run.config, run.report.memory
    actor = cfg.actor_rollout_ref.actor
    mega, rollout = actor.megatron, cfg.actor_rollout_ref.rollout
    layout = run.report.layout
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    off = set(m.offloaded)
    sharding = f"sharded over DP={layout.dp}" if mega.use_distributed_optimizer else "not sharded"
    table = Table(title=f"estimated memory per GPU (GiB), GPU = {gpu_memory_gib(cfg):.1f} GiB")
    table.add_column("what")
    table.add_column("GiB", justify="right")
    table.add_column("note")
    lora = cfg.actor_rollout_ref.model.lora.rank
    frozen = f"frozen base + LoRA rank {lora}" if lora else ""
    rows = [
        (
            f"actor weights ({mega.dtype})",
            m.weights,
            "; ".join(filter(None, [frozen, "offloaded between phases" if "parameters" in off else ""])),
        ),
        (
            "gradients (fp32 main grads)",
            m.gradients,
            "; ".join(
                filter(
                    None, ["adapters only" if lora else "", "offloaded between phases" if "gradients" in off else ""]
                )
            ),
        ),
        (
            "optimizer on the GPU (fp32 master + Adam)",
            m.optimizer,
            "; ".join(
                [sharding]
                + ([f"{on_cpu:.0%} of Adam stepped on the CPU"] if (on_cpu := optimizer_offloaded(cfg)) else [])
                + (["in host memory between updates"] if "optimizer" in off else [])
            ),
        ),
        (
            f"activations ({update_micro_batch(cfg)} x {seq} tokens)",
            m.activations,
            "recomputed" if run.config.actor_rollout_ref.model.enable_gradient_checkpointing else "",
        ),
        ("logits + log-softmax", m.logits, "vocab-parallel"),
        (
            "reference model",
            m.reference,
            "the actor's base, adapters off" if lora else "offloaded between uses" if "reference" in off else "",
        ),
        (f"rollout weights (TP={rollout.tensor_model_parallel_size})", m.rollout, rollout.name),
        ("rollout KV-cache budget", m.kv_cache, f"~{m.kv_sequences:.0f} full sequences at once"),
    ]
    for what, gib, note in rows:
        table.add_row(what, f"{gib:.1f}", note)
    for phase, gib in m.phases.items():
        table.add_row(f"phase: {phase}", f"{gib:.1f}", "peak" if phase == m.peak_phase else "", style="bold")
    if m.host:
        node = m.host * cfg.trainer.n_gpus_per_node
        table.add_row("host memory per node", f"{node:.1f}", "offloaded state", style="bold")
        save = m.host_at_save * cfg.trainer.n_gpus_per_node
        gathered = memory_options(cfg).reshardable_checkpoint  # as the estimate counted it
        how = "+ the optimizer state gathered" if gathered else "+ two tensors in flight to the files"
        table.add_row("host memory per node, saving", f"{save:.1f}", how)
    return table
