"""``grpo plan``: the layout (TP/PP/EP), offload and micro-batch the planner recommends for a model on given GPUs,
printed as the overrides that set them."""

import argparse

from grpo_core.cli.common import UserError, console
from grpo_core.models import load_model_shape
from grpo_core.planning.planner import plan_layout


def add_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="recommend TP/PP/EP, offload and micro-batch for a model")
    plan.add_argument("--model", required=True, help="hub id, local directory, or a model of the built-in table")
    plan.add_argument("--gpus", type=int, required=True)
    plan.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU")
    plan.add_argument("--seq-len", type=int, default=2048, help="prompt + response tokens")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on a frozen base (0: off)")
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.gpus < 1 or args.gpu_memory <= 0 or args.seq_len < 1:
        raise UserError("--gpus, --gpu-memory and --seq-len must be positive")
    shape = load_model_shape(args.model)
    if args.lora_rank < 0:
        raise UserError("--lora-rank must be >= 0 (0: all parameters train)")
    plan = plan_layout(shape, args.gpus, args.gpu_memory, args.seq_len, args.gpus_per_node, lora_rank=args.lora_rank)
    if plan is None:
        raise UserError(
            f"{args.model} ({shape.num_params / 1e9:.1f}B) does not fit on {args.gpus} x {args.gpu_memory:g} GiB "
            "even with full offload; add GPUs"
        )
    layout, opts = plan.layout, plan.options
    console.print(f"[bold]{args.model}[/] on {args.gpus} x {args.gpu_memory:g} GiB, {args.seq_len} tokens per sequence")
    console.print(f"layout: {layout.describe()}", markup=False)
    for reason in plan.reasons:
        console.print(f"  - {reason}", markup=False)
    prefix = "actor_rollout_ref.actor.megatron."
    overrides = [
        f"{prefix}tensor_model_parallel_size={layout.tp}",
        f"{prefix}pipeline_model_parallel_size={layout.pp}",
        f"{prefix}param_offload={str(opts.param_offload).lower()}",
        f"{prefix}grad_offload={str(opts.grad_offload).lower()}",
        f"{prefix}optimizer_offload={str(bool(opts.optimizer_offload)).lower()}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={plan.micro_batch}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={plan.rollout_tp}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={plan.rollout_utilization}",
    ]
    if layout.ep > 1:
        overrides.append(f"{prefix}expert_model_parallel_size={layout.ep}")
    if args.lora_rank:
        overrides.append(f"actor_rollout_ref.model.lora.rank={args.lora_rank}")
    first, last = plan.uneven_stages
    if first:
        overrides.append(f"+{prefix}override_transformer_config.num_layers_in_first_pipeline_stage={first}")
        overrides.append(f"+{prefix}override_transformer_config.num_layers_in_last_pipeline_stage={last}")
    console.print("overrides:\n  " + " \\\n  ".join(overrides), markup=False, highlight=False, soft_wrap=True)
    phases = ", ".join(f"{k} {v:.1f}" for k, v in plan.estimate.phases.items())
    console.print(f"estimated GiB per GPU by phase: {phases}", markup=False)
    return 0
