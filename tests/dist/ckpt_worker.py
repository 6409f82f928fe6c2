"""Run by torchrun from tests/test_checkpoint.py: a few GRPO updates with a checkpoint after each,
optionally killed during a save or during a step, and resumed.

Each step's batch is a pure function of the step number (the "data position"), so an interrupted and
resumed run must reproduce the uninterrupted run's metrics exactly. Rank 0 appends one JSON line per
finished step to --out.
"""

import argparse
import json
import os
import resource
import sys
from pathlib import Path


import torch
import torch.distributed as dist

from grpo_core.actor.actor import ActorSettings, MegatronActor
from grpo_core.actor.loss import LossSettings
from grpo_core.actor.parallel import init_distributed, init_model_parallel
from grpo_core.models.lora_settings import LoRASettings
from grpo_core.models.shape import load_model_shape
from grpo_core.planning.layout import ParallelLayout
from grpo_core.checkpoint import manager as checkpoint
from grpo_core.checkpoint.manager import CheckpointManager, CheckpointSaveError
from tests.dist.actor_worker import synthetic_batch, with_old_and_ref


def crash_during_save_of(step: int) -> None:
    """Die after the shards are written but before the checkpoint is published."""
    real_replace = os.replace

    def replace(src, dst):
        if str(src).endswith(f"step_{step:06d}.partial"):
            os._exit(17)
        return real_replace(src, dst)

    checkpoint.os.replace = replace


def disk_full_during_save_of(step: int, manager: CheckpointManager) -> None:
    """Files may grow to 1 MB from the save of ``step`` on (RLIMIT_FSIZE): the shards are bigger."""
    real_save = manager.save

    def save(at, *args, **kwargs):
        if at == step:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return real_save(at, *args, **kwargs)

    manager.save = save


def forget_adam(policy: MegatronActor) -> None:
    """What a fresh optimizer over the current weights has: fp32 copies of the (bf16) weights, zero moments, no
    steps taken (the lr schedule goes on)."""
    policy.optimizer.reload_model_params()
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        for state in opt.optimizer.state.values():
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
            state["step"] = torch.zeros_like(state["step"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--crash", default="none", help="none | save:K | step:K | disk:K (disk full in save K)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-rank", action="store_true", help="the optimizer saved as each rank's own shards")
    parser.add_argument("--contents", default="model,optimizer,extra", help="what checkpoints hold and resumes load")
    parser.add_argument("--forget-adam-at", type=int, default=0, help="zero Adam's state before this step's update")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: LoRA adapters of this rank on a frozen base")
    args = parser.parse_args()
    init_distributed()
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=args.tp)
    init_model_parallel(layout, seed=7)
    shape = load_model_shape(args.hf_dir)
    settings = ActorSettings(
        layout=layout,
        lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_style="cosine",
        total_optimizer_steps=10,
        mini_batch_rows=4,
        micro_batch_rows=2,
        loss=LossSettings(kl_loss_coef=0.1),
        reshardable_checkpoint=not args.per_rank,
        dtype=args.dtype,
        # B initialised random too: the adapters act from the first step, and their Adam state matters on resume
        lora=LoRASettings(rank=args.lora_rank, alpha=2.0 * args.lora_rank, b_init="kaiming"),
    )
    policy = MegatronActor(shape, settings, hf_path=args.hf_dir)
    manager = CheckpointManager(args.root, save_freq=1, keep=3)
    hf_config = json.loads((Path(args.hf_dir) / "config.json").read_text())
    start, contents = 0, frozenset(args.contents.split(","))
    resume = manager.resolve_resume("auto")
    if resume is not None:
        start = manager.load(resume, policy, contents)["data_position"]
    kind, _, at = args.crash.partition(":")
    if kind == "save":
        crash_during_save_of(int(at))
    if kind == "disk":
        disk_full_during_save_of(int(at), manager)
    for step in range(start + 1, args.steps + 1):
        batch = synthetic_batch(shape.vocab_size, rows=8)
        batch.input_ids = (batch.input_ids + step) % shape.vocab_size  # the data changes with the position
        log_probs, _ = policy.compute_log_prob(batch)
        batch = with_old_and_ref(batch, log_probs)
        if kind == "step" and step == int(at):
            os._exit(18)
        if step == args.forget_adam_at:
            forget_adam(policy)
        metrics = policy.update(batch)
        after, _ = policy.compute_log_prob(batch)
        if dist.get_rank() == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps({"step": step, "metrics": metrics, "log_probs": after.tolist()}) + "\n")
        try:
            state = {"data_position": step, "hf_config": hf_config, "dtype": args.dtype}
            if args.lora_rank:
                state["lora"] = {**settings.lora.record(), "base_model": args.hf_dir}
            manager.save(step, policy, state, contents)
        except CheckpointSaveError as e:  # as `grpo train` reports it (grpo_core.cli.main)
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
