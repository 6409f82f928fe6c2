"""Start-up to the first rollout, and actor -> engine weight-sync seconds, as the trainer does them.

    BENCH_START=$(date +%s.%N) torchrun --standalone --nproc-per-node 1 bench/sync_startup.py \
        --model Qwen/Qwen2.5-7B --hf-dir /tmp/qwen7b --out sync.json

From the launch (``BENCH_START``, seconds since the epoch, set just before ``torchrun``): the trainable
Megatron actor is built and loads ``--hf-dir`` (random weights of ``--model``'s shape when omitted), the
static engine is built empty on every rank and takes the actor's weights (gathered over TP, as HF
tensors), then generates the first rollout (``--prompts`` x ``--n`` samples of ``--new-tokens``). Then
``--syncs`` more weight syncs are timed. Prints a table last, writes JSON.
"""

import argparse
import json
import os
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-7B")
    p.add_argument("--hf-dir", default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--out", default="sync_startup.json")
    args = p.parse_args()
    launched = float(os.environ.get("BENCH_START", time.time()))
    marks: dict[str, float] = {"imports": time.time() - launched}

    import torch.distributed as dist

    from grpo_core.actor.actor import ActorSettings, MegatronActor
    from grpo_core.actor.parallel import init_distributed, init_model_parallel
    from grpo_core.models.bridge import gather_hf_weights
    from grpo_core.models.shape import load_model_shape
    from grpo_core.planning.layout import ParallelLayout
    from grpo_core.rollout.base import SamplingSettings
    from grpo_core.rollout.static import StaticEngine

    def mark(name: str, since: float) -> float:
        torch.cuda.synchronize()
        now = time.time()
        marks[name] = now - since
        return now

    t = time.time()
    init_distributed()
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=args.tp)
    init_model_parallel(layout, seed=1)
    shape = load_model_shape(args.hf_dir or args.model)
    settings = ActorSettings(layout=layout, dtype="bfloat16", sequence_parallel=args.tp > 1, lr=1e-6)
    actor = MegatronActor(shape, settings, hf_path=args.hf_dir)
    t = mark("actor (build + load)", t)
    engine = StaticEngine(
        shape,
        [-1],
        dtype="bfloat16",
        device="cuda",
        max_batch_size=args.prompts * args.n,
        max_model_len=256 + args.new_tokens,
    )
    t = mark("engine (build)", t)

    def sync() -> None:
        _, tensors = gather_hf_weights(actor.model, shape, dtype="bfloat16", dst=None)
        engine.update_weights(tensors)

    sync()
    t = mark("first sync", t)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, shape.vocab_size, (128,), generator=g).tolist() for _ in range(args.prompts)]
    engine.generate(prompts, SamplingSettings(n=args.n, max_new_tokens=args.new_tokens))
    t = mark("first rollout", t)
    startup = t - launched
    seconds = []
    for _ in range(args.syncs):
        start = time.time()
        sync()
        torch.cuda.synchronize()
        seconds.append(time.time() - start)
    if dist.get_rank() == 0:
        result = {
            "model": args.model,
            "tp": args.tp,
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "loaded_from": args.hf_dir,
            "startup_to_first_rollout_s": startup,
            "phases_s": marks,
            "sync_s": seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\n{args.model}, actor TP={args.tp}, {'weights from ' + args.hf_dir if args.hf_dir else 'random init'}")
        print("| phase | seconds |")
        print("| --- | --- |")
        for name, s in marks.items():
            print(f"| {name} | {s:.1f} |")
        print(f"| **start-up to first rollout** | **{startup:.1f}** |")
        print(f"| weight sync (mean of {len(seconds)}) | {sum(seconds) / len(seconds):.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
