"""Training-step throughput per GPU: the Megatron actor vs a plain Hugging Face training step, random weights.

    torchrun --standalone --nproc-per-node 2 bench/actor_step.py --model Qwen/Qwen2.5-7B --tp 2
    python bench/actor_step.py --impl hf --model Qwen/Qwen2.5-7B --batch 4

Same model config, same batch (``--batch`` rows per data-parallel rank of ``--seq`` tokens, no padding),
bf16. Phases, each the median of ``--steps`` after ``--warmup``:
- fwd+bwd: megatron: the GRPO loss (log-probs of the last ``--response`` tokens from the vocab-parallel
  logits, clipped policy loss, low-var KL) and its backward, gradients reduced over DP, no optimizer step;
  HF: ``model(input_ids, labels=input_ids).loss.backward()`` per micro-batch (SDPA attention), the usual
  training step.
- update: fwd+bwd plus the optimizer (megatron: fp32 master weights, distributed Adam, grad clipping;
  HF: ``torch.optim.AdamW(fused=True)`` on the bf16 parameters).
- log-prob (megatron only): the forward-only old/ref log-prob pass.
Tokens/s are per GPU; FLOPs per token = 6 N + 6 L h s (causal attention), as in
../shared/notes/gpu-baseline.md. Writes JSON to ``--out``; prints a table row last.
"""

import argparse
import json
import statistics
import time

import torch
import yaml


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, warmup: int, steps: int) -> float:
    """The median step: a one-off stall (a recompile, the allocator) does not move it."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


KERNEL_KINDS = {
    "gemm": ("gemm", "cutlass", "xmma", "nvjet", "cublas"),
    "attention": ("flash", "fmha", "attention", "efficient"),
    "nccl": ("nccl",),
}


MEMORY_OPS = ("aten::copy_", "aten::fill_", "aten::zero_", "aten::cat", "aten::mul_", "aten::add_", "aten::mul")


def kernel_breakdown(fn) -> dict:
    """GPU time of one call of ``fn`` by kind of kernel (ms), the kernel count and the wall time (ms):
    what the step is bound by. Whatever is not GEMM, attention or NCCL is element-wise work and copies;
    the largest of those kernels, and the copies/fills/adds by the shapes they ran on, say what to fuse next."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        start = time.perf_counter()
        fn()
        synchronize()
        wall = time.perf_counter() - start
    out = dict.fromkeys([*KERNEL_KINDS, "other"], 0.0) | {"kernels": 0, "wall": wall * 1e3}
    others, ops = [], []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.device_type != DeviceType.CUDA:
            if event.key in MEMORY_OPS and event.device_time_total > 0:
                ops.append((round(event.device_time_total / 1e3, 2), event.count, event.key, str(event.input_shapes)))
            continue
        ms = event.self_device_time_total / 1e3
        if ms <= 0 or event.key.startswith("## "):  # "## Call CompiledFxGraph": a range over kernels listed too
            continue
        kind = next((k for k, marks in KERNEL_KINDS.items() if any(m in event.key.lower() for m in marks)), "other")
        out[kind] += ms
        out["kernels"] += event.count
        if kind == "other":
            others.append((round(ms, 2), event.count, event.key[:120]))
    out["top_other"] = sorted(others, reverse=True)[:15]  # (ms, calls, kernel)
    out["top_memory_ops"] = sorted(ops, reverse=True)[:15]  # (ms, calls, op, input shapes)
    return out


def megatron_phases(args, shape) -> tuple[dict, int, int]:
    import torch.distributed as dist

    from grpo_core.actor.actor import ActorSettings, MegatronActor
    from grpo_core.actor.loss import LossSettings
    from grpo_core.actor.parallel import init_distributed, init_model_parallel
    from grpo_core.data.batch import RolloutBatch
    from grpo_core.planning.layout import ParallelLayout

    init_distributed()
    world = dist.get_world_size()
    layout = ParallelLayout(world_size=world, tp=args.tp, pp=args.pp)
    init_model_parallel(layout, seed=1)
    rows = args.batch * layout.dp
    settings = ActorSettings(
        layout=layout,
        dtype="bfloat16",
        sequence_parallel=not args.no_sequence_parallel,
        lr=1e-6,
        mini_batch_rows=rows,
        micro_batch_rows=args.micro_batch,
        loss=LossSettings(kl_loss_coef=0.001),
        transformer_overrides={k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.override)} or None,
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
    phases = {"fwd_bwd": timed(lambda: policy.forward_backward(batch), args.warmup, args.steps)}
    if not args.skip_update:
        phases["update"] = timed(lambda: policy.update(batch), args.warmup, args.steps)
    phases["log_prob"] = timed(lambda: policy.compute_log_prob(batch), 1, args.steps)
    if args.profile:
        phases["breakdown"] = kernel_breakdown(lambda: policy.forward_backward(batch))
    return phases, rows, world


def hf_phases(args) -> tuple[dict, int, int]:
    from transformers import AutoModelForCausalLM

    from grpo_core.models.known_configs import transformers_config

    config = transformers_config(args.model)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def fwd_bwd():  # gradient accumulation over micro-batches, as a Trainer does
        model.zero_grad(set_to_none=True)
        for micro in ids.split(args.micro_batch):
            model(input_ids=micro, labels=micro).loss.backward()

    def update():
        fwd_bwd()
        optimizer.step()

    phases = {"fwd_bwd": timed(fwd_bwd, args.warmup, args.steps)}
    if not args.skip_update:
        phases["update"] = timed(update, args.warmup, args.steps)
    if args.profile:
        phases["breakdown"] = kernel_breakdown(fwd_bwd)
    return phases, args.batch, 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("megatron", "hf"), default="megatron")
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="rows per data-parallel rank")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--response", type=int, default=896)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--skip-update", action="store_true", help="no optimizer (a model too big for its states)")
    p.add_argument("--profile", action="store_true", help="also break one fwd+bwd down by kernel kind")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FLAG=VALUE",
        help="a TransformerConfig override (override_transformer_config), e.g. apply_rope_fusion=false",
    )
    p.add_argument("--label", default="", help="a note for the table (e.g. what was switched off)")
    p.add_argument("--out", default="actor_step.json")
    args = p.parse_args()

    from grpo_core.models.shape import load_model_shape

    shape = load_model_shape(args.model)
    phases, rows, gpus = megatron_phases(args, shape) if args.impl == "megatron" else hf_phases(args)
    breakdown = phases.pop("breakdown", None)
    tokens = rows * args.seq
    flops_per_token = 6 * shape.active_params + 6 * shape.num_layers * shape.hidden_size * args.seq
    result = {
        "impl": args.impl,
        "label": args.label,
        "model": args.model,
        "gpus": gpus,
        "tp": args.tp if args.impl == "megatron" else 1,
        "sequence_parallel": args.impl == "megatron" and args.tp > 1 and not args.no_sequence_parallel,
        "rows": rows,
        "seq": args.seq,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "fwd_bwd_kernel_ms": breakdown,
    }
    for phase, seconds in phases.items():
        result[f"{phase}_s"] = seconds
        result[f"{phase}_tokens_per_s_per_gpu"] = tokens / seconds / gpus
        if phase != "log_prob":  # 6 N + 6 L h s counts a backward; a forward-only pass does a third of it
            result[f"{phase}_tflops_per_gpu"] = tokens * flops_per_token / seconds / gpus / 1e12
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        cells = [f"{result.get(f'{p}_tokens_per_s_per_gpu', 0):,.0f}" for p in ("fwd_bwd", "update", "log_prob")]
        print(
            f"| {args.impl} {args.label} | {args.model} | {gpus} (TP={result['tp']}) | {rows} x {args.seq} | "
            f"{' | '.join(cells)} | {result['fwd_bwd_tflops_per_gpu']:.0f} | {result['peak_mem_gib']:.1f} |"
        )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
