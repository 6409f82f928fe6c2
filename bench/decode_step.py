"""The static engine's decode step on one GPU: milliseconds per step with and without CUDA graphs, and,
eagerly, one step's kernel time by kind, for each decode attention (SDPA row by row, the cascade that reads a
prompt's keys once for its samples); then the sampler alone on the same logits shape.

    python bench/decode_step.py --model Qwen/Qwen2.5-1.5B --rows 512 2048 [--attention sdpa cascade]

Random weights (N(0, 0.02)), n = 8, 64-192-token prompts. A step's time is the difference between a
128-token and a 2-token generation over 126 steps, so prefill drops out.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from grpo_core.diagnostics.profile import kernel_kind
from grpo_core.models.shape import load_model_shape
from grpo_core.rollout.base import SamplingSettings
from grpo_core.rollout.sampler import sample, sample_compiled
from grpo_core.rollout.static import StaticEngine


def seconds(fn, *args, repeats: int = 1) -> float:
    """Mean seconds per call of ``fn(*args)``."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    p.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--top", type=int, default=0, help="also list the eager step's N costliest kernels")
    p.add_argument("--attention", nargs="+", default=["sdpa", "cascade"], help="the engine's decode attention(s)")
    args = p.parse_args()
    shape = load_model_shape(args.model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 193, (max(args.rows) // 8,), generator=g).tolist()
    prompts = [torch.randint(0, shape.vocab_size, (n,), generator=g).tolist() for n in lengths]
    top: list[str] = []
    print("| rows | attention | CUDA graphs | decode step ms | eager step: GEMM / attention / other kernel ms |")
    print("| --- | --- | --- | --- | --- |")
    for rows, attention, graphs in ((r, a, g) for r in args.rows for a in args.attention for g in (True, False)):
        engine = StaticEngine(
            shape, [-1], "bfloat16", "cuda", rows, max_model_len=448, cuda_graphs=graphs, attention=attention
        )
        with torch.no_grad():
            for t in engine._params.values():
                t.normal_(0, 0.02)
        chosen = prompts[: rows // 8]
        for tokens in (2, 128):  # capture and compile both shapes before timing either
            engine.generate(chosen, SamplingSettings(n=8, max_new_tokens=tokens))
        short = seconds(engine.generate, chosen, SamplingSettings(n=8, max_new_tokens=2))
        long = seconds(engine.generate, chosen, SamplingSettings(n=8, max_new_tokens=128))
        kinds = ""
        if not graphs:
            st, steps = next(v for k, v in engine._decoders.items() if k[:2] == (rows, 128))
            # mid-response: 150-slot prompts, response token 100 (the SDPA step attends over 256 slots, its bucket)
            step = steps[engine._length(250, 447)]
            st["step"].fill_(100), st["slot"].fill_(250), st["position"].fill_(250)
            if engine.cascade:
                st["width"].fill_(150), st["start"].zero_()
            with torch.no_grad():  # as generate runs it (grad mode would recompile the sampler in the window)
                step()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
            ms_by_kind = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
            for ev in prof.key_averages():
                kind = kernel_kind({"name": ev.key, "cat": "kernel"})
                ms_by_kind[kind if kind in ms_by_kind else "other"] += ev.self_device_time_total / 1e3 / 5
            kinds = " / ".join(f"{ms:.1f}" for ms in ms_by_kind.values())
            ranked = sorted(prof.key_averages(), key=lambda ev: -ev.self_device_time_total)[: args.top]
            for ev in ranked:
                ms = ev.self_device_time_total / 5e3
                top.append(f"| {rows} | {attention} | {ev.key[:70]} | {ev.count // 5} | {ms:.3f} |")
        print(f"| {rows} | {attention} | {graphs} | {(long - short) / 126 * 1e3:.1f} | {kinds} |")
        del engine
        torch.cuda.empty_cache()
    if top:
        print("\n| rows | attention | kernel (eager step) | launches per step | ms per step |\n|" + " --- |" * 5)
        print("\n".join(top))
    temperature = torch.ones((), device="cuda")
    print("\n| rows | sampler | ms per call |\n| --- | --- | --- |")
    for rows in args.rows:
        logits = torch.randn(rows, shape.vocab_size, device="cuda", dtype=torch.bfloat16)
        for name, fn in (("eager", sample), ("compiled", sample_compiled)):
            seconds(fn, logits, temperature, False, -1, 1.0, repeats=3)  # compile, warm up
            ms = seconds(fn, logits, temperature, False, -1, 1.0, repeats=10) * 1e3
            print(f"| {rows} | {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
