"""Throughput of the Megatron actor's GRPO update on GPUs (random weights of a real architecture).

    torchrun --standalone --nproc-per-node 2 bench/actor_step.py --model Qwen/Qwen2.5-1.5B --tp 2

Measures old-log-prob forward and the full update (forward + backward + distributed Adam step) on a
synthetic batch with no padding; prints a table last and writes JSON to --out. Tokens/s are per GPU:
tokens of the batch / seconds / GPUs. FLOPs per token = 6 N + 6 L h s (causal attention), as in
../shared/notes/gpu-baseline.md, so the figures sit next to its table.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

from grpo_core.actor.actor import ActorSettings, MegatronActor
from grpo_core.actor.loss import LossSettings
from grpo_core.actor.parallel import init_distributed, init_model_parallel
from grpo_core.data.batch import RolloutBatch
from grpo_core.models.shape import load_model_shape
from grpo_core.planning.layout import ParallelLayout


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--response", type=int, default=896)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--out", default="actor_step.json")
    args = p.parse_args()

    init_distributed()
    world = dist.get_world_size()
    layout = ParallelLayout(world_size=world, tp=args.tp, pp=args.pp)
    init_model_parallel(layout, seed=1)
    shape = load_model_shape(args.model)
    rows = args.batch * layout.dp
    settings = ActorSettings(
        layout=layout,
        dtype=args.dtype,
        sequence_parallel=not args.no_sequence_parallel,
        lr=1e-6,
        mini_batch_rows=rows,
        micro_batch_rows=args.micro_batch,
        loss=LossSettings(kl_loss_coef=0.001),
    )
    policy = MegatronActor(shape, settings, hf_path=None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (rows, args.seq), generator=g)
    batch = RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.ones(rows, args.response),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, args.response).contiguous(),
    )
    log_probs, _ = policy.compute_log_prob(batch)
    batch.old_log_probs = batch.ref_log_probs = log_probs

    for _ in range(args.warmup):
        policy.update(batch)
    t_update = timed(lambda: policy.update(batch), args.steps)
    t_logprob = timed(lambda: policy.compute_log_prob(batch), args.steps)

    tokens = rows * args.seq
    flops_per_token = 6 * shape.active_params + 6 * shape.num_layers * shape.hidden_size * args.seq
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    result = {
        "model": args.model,
        "gpus": world,
        "tp": args.tp,
        "pp": args.pp,
        "dp": layout.dp,
        "dtype": args.dtype,
        "sequence_parallel": not args.no_sequence_parallel,
        "batch_per_dp": args.batch,
        "seq": args.seq,
        "update_s": t_update,
        "log_prob_s": t_logprob,
        "update_tokens_per_s_per_gpu": tokens / t_update / world,
        "update_tflops_per_gpu": tokens * flops_per_token / t_update / world / 1e12,
        "log_prob_tokens_per_s_per_gpu": tokens / t_logprob / world,
        "peak_mem_gib": peak,
    }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print("| model | GPUs (TP) | batch x seq | phase | tokens/s per GPU | TFLOP/s per GPU | peak GiB |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        print(
            f"| {args.model} | {world} (TP={args.tp}) | {rows} x {args.seq} | update (fwd+bwd+Adam) | "
            f"{result['update_tokens_per_s_per_gpu']:,.0f} | {result['update_tflops_per_gpu']:.0f} | {peak:.1f} |"
        )
        print(
            f"| {args.model} | {world} (TP={args.tp}) | {rows} x {args.seq} | log-prob forward | "
            f"{result['log_prob_tokens_per_s_per_gpu']:,.0f} | | |"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
