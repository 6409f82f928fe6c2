"""The static engine's generation as a GRPO step sees it, timed part by part: one graph per chunk, the cache
and graphs dropped after every rollout (``free_cache_engine=true``), then kept.

    python bench/gen_phase.py MODEL_DIR [--blob-gib 70]

Random weights (N(0, 0.02)), 64 random prompts of 60-199 tokens x 8 samples x 256 new tokens, 512 rows, a
512-slot cache (GSM8K's 256 + 256). ``--blob-gib``: before each call, allocate and free that much in 256 MiB
blocks, as an update leaves the caching allocator. Prints a row per call: seconds, and the graph capture,
prefill and collection inside them.
"""

import argparse
import time

import torch

from grpo_core.models.shape import load_model_shape
from grpo_core.rollout.base import SamplingSettings
from grpo_core.rollout.static import StaticEngine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--blob-gib", type=int, default=0)
    args = p.parse_args()
    shape = load_model_shape(args.model)
    engine = StaticEngine(shape, [-1], "bfloat16", "cuda", 512, max_model_len=512, grow_length=False)
    with torch.no_grad():
        for t in engine._params.values():
            t.normal_(0, 0.02)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(60, 200, (64,), generator=g).tolist()
    prompts = [torch.randint(0, shape.vocab_size, (n,), generator=g).tolist() for n in lengths]
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn(*a, **k)
            torch.cuda.synchronize()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
            return result

        return wrapper

    for name in ("_capture", "_prefill", "_collect"):
        setattr(engine, name, timed(name.strip("_"), getattr(engine, name)))
    print("| call | after it | seconds | inside |\n| --- | --- | --- | --- |")
    for i, asleep in enumerate([True, True, True, False, False]):
        spent.clear()
        if args.blob_gib:
            blocks = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(args.blob_gib * 4)]
            del blocks
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, SamplingSettings(n=8, max_new_tokens=256))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if asleep:
            engine.sleep()
        inside = ", ".join(f"{k} {v:.2f}" for k, v in spent.items())
        print(f"| {i} | {'sleep' if asleep else 'kept'} | {seconds:.2f} | {inside} |")


if __name__ == "__main__":
    main()
