"""A GRPO step's computed lower bound, phase by phase, next to its measured seconds (`grpo train`'s metrics.jsonl).

    python bench/step_limit.py --model MODEL_DIR RUN/metrics.jsonl... [--measure | --tflops 790 --tbps 4.3]
        [--optimizer-steps 2] [--n 8] [--json OUT.json]

GEMM phases (old log-prob, ref, update, prefill) are bound by their FLOPs at the measured bf16 matmul rate;
each decode step by the larger of its FLOPs at that rate and its bytes (bf16 weights + the KV cache read so far)
at the measured memory bandwidth; the optimizer step and the weight sync by their bytes. Where a run logs the
static engine's decode loop (``rollout/decode_s``), its own bound is shown beside it. ``--measure`` measures
both ceilings on this GPU first (an 8192^3 bf16 matmul; a 4 GiB device copy, bytes read + written). Every
response is taken to run ``response/length_max`` decode steps with the batch's mean number of rows active.
FLOPs per token: 2 x matmul weights forward (the input embedding is a lookup, not a GEMM) + causal attention's
2 x layers x q width x mean sequence length; training is 3x that.
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo_core.models.shape import ModelShape, ModelShapeError, load_model_shape

PHASES = ("gen", "old_log_prob", "ref", "update", "sync")
ADAM_BYTES_PER_PARAM = 34  # fp32 master r/w 8, fp32 grad read 4 + zeroing 4, m and v r/w 16, bf16 weight write 2


@dataclass(frozen=True)
class StepWork:
    rows: int
    prompt_len: float  # mean, tokens
    response_len: float  # mean
    response_max: int  # decode steps
    n: int = 1  # responses per prompt: a prompt is prefilled once for its group

    @property
    def tokens(self) -> float:
        return self.rows * (self.prompt_len + self.response_len)


def matmul_params(shape: ModelShape) -> int:
    """Weights a token's forward multiplies by: all active ones, less an untied input embedding (a lookup)."""
    return shape.active_params - (0 if shape.tie_embeddings else shape.vocab_size * shape.hidden_size)


def forward_flops(shape: ModelShape, tokens: float, mean_context: float) -> float:
    """Forward FLOPs of ``tokens`` at causal attention's mean context ``mean_context`` (half the sequence)."""
    attention = 4 * shape.num_layers * shape.num_attention_heads * shape.head_dim * mean_context
    return tokens * (2 * matmul_params(shape) + attention)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> int:
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * dtype_bytes


def decode_bound(shape: ModelShape, work: StepWork, flops_per_s: float, bytes_per_s: float) -> float:
    """Each decode step at its roofline: its FLOPs, or its bytes (weights + the KV cache read once)."""
    seconds = 0.0
    active = work.rows * work.response_len / max(work.response_max, 1)
    weight_bytes = 2 * matmul_params(shape)
    for j in range(work.response_max):
        context = work.prompt_len + j
        flops = forward_flops(shape, active, context)
        read = weight_bytes + active * context * kv_bytes_per_token(shape)
        seconds += max(flops / flops_per_s, read / bytes_per_s)
    return seconds


def generation_bound(shape: ModelShape, work: StepWork, flops_per_s: float, bytes_per_s: float) -> float:
    """Each prompt prefilled once at the matmul rate, then the decode steps."""
    prefill = forward_flops(shape, work.rows / work.n * work.prompt_len, work.prompt_len / 2) / flops_per_s
    return prefill + decode_bound(shape, work, flops_per_s, bytes_per_s)


def phase_bounds(
    shape: ModelShape, work: StepWork, flops_per_s: float, bytes_per_s: float, optimizer_steps: int
) -> dict[str, float]:
    """Lower-bound seconds of each phase of one GRPO step."""
    seq = work.prompt_len + work.response_len
    log_prob = forward_flops(shape, work.tokens, seq / 2) / flops_per_s
    update = 3 * log_prob + optimizer_steps * ADAM_BYTES_PER_PARAM * shape.num_params / bytes_per_s
    return {
        "gen": generation_bound(shape, work, flops_per_s, bytes_per_s),
        "old_log_prob": log_prob,
        "ref": log_prob,
        "update": update,
        "sync": 2 * 2 * shape.num_params / bytes_per_s,  # one bf16 copy, read + write
    }


def step_work(record: dict, n: int = 1) -> StepWork:
    prompt, response = record["prompt/length_mean"], record["response/length_mean"]
    return StepWork(
        rows=round(record["perf/total_tokens"] / (prompt + response)),
        prompt_len=prompt,
        response_len=response,
        response_max=int(record["response/length_max"]),
        n=n,
    )


def measure_ceilings() -> tuple[float, float]:
    """(bf16 matmul FLOP/s, device-copy bytes/s) on this GPU: medians of timed repeats on random data."""
    import torch

    def median_seconds(fn, repeats: int = 20) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2]

    def matmul_rate(n: int = 8192) -> float:
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return 2 * n**3 / median_seconds(lambda: a @ b)

    def copy_rate(numel: int = 2**30) -> float:  # 4 GiB of fp32
        src = torch.randn(numel, device="cuda")
        dst = torch.empty_like(src)
        return 2 * numel * 4 / median_seconds(lambda: dst.copy_(src))

    rates = matmul_rate(), copy_rate()
    torch.cuda.empty_cache()
    return rates


def rows_for(
    name: str, records: list[dict], shape, flops_per_s, bytes_per_s, optimizer_steps, n: int = 1
) -> list[dict]:
    out = []
    for r in records:
        if "timing/step" not in r or "perf/total_tokens" not in r:
            continue
        work = step_work(r, n)
        bounds = phase_bounds(shape, work, flops_per_s, bytes_per_s, optimizer_steps)
        # the separate old-log-prob pass skips the first mini-batch, whose update's forward gives its log-probs
        total = r["perf/total_tokens"]
        bounds["old_log_prob"] *= r.get("perf/old_log_prob_tokens", total) / total
        # a phase the run skips (no reference; no separate old-log-prob pass) bounds nothing
        bounds = {p: b if f"timing/{p}" in r else 0.0 for p, b in bounds.items()}
        measured = {p: r.get(f"timing/{p}", 0.0) for p in PHASES}
        out.append(
            {
                "run": name,
                "step": r["step"],
                "measured": measured,
                "bound": bounds,
                "step_measured": r["timing/step"],
                "step_bound": sum(bounds.values()),
                # the static engine's decode loop alone (rollout/decode_s), where the run logs it
                "decode_measured": r.get("rollout/decode_s", 0.0),
                "decode_bound": decode_bound(shape, work, flops_per_s, bytes_per_s),
                "tokens_per_s": r.get("perf/throughput", 0.0),
            }
        )
    return out


def table(results: list[dict]) -> str:
    names = [f"{p} s (bound, ×)" for p in PHASES] + ["step s (bound, ×)", "decode loop s (bound, ×)"]
    lines = ["| run | step | " + " | ".join(names) + " | tok/s/GPU |", "|" + " --- |" * (len(names) + 3)]
    for x in results:
        pairs = [(x["measured"][p], x["bound"][p]) for p in PHASES]
        pairs += [(x["step_measured"], x["step_bound"]), (x["decode_measured"], x["decode_bound"])]
        cells = [f"{m:.2f} ({b:.2f}, {_ratio(m, b)})" if m else "–" for m, b in pairs]
        lines.append(f"| {x['run']} | {x['step']} | " + " | ".join(cells) + f" | {x['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def _ratio(measured: float, bound: float) -> str:
    return f"{measured / bound:.2f}×" if bound > 0 else "–"  # two places: the target is 1.5×


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl of `grpo train` runs")
    parser.add_argument("--model", required=True, help="the runs' model (directory or known name)")
    parser.add_argument("--measure", action="store_true", help="measure the two ceilings on this GPU")
    parser.add_argument("--tflops", type=float, default=790.0, help="bf16 matmul TFLOP/s (H200, measured)")
    parser.add_argument("--tbps", type=float, default=4.3, help="device-copy TB/s (H200, measured)")
    parser.add_argument("--optimizer-steps", type=int, default=2, help="optimizer steps per GRPO step")
    parser.add_argument("--n", type=int, default=1, help="the runs' rollout.n: each prompt is prefilled once")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    if args.n < 1 or args.optimizer_steps < 0:
        print(
            f"error: --n must be at least 1 and --optimizer-steps not negative (got {args.n}, {args.optimizer_steps})",
            file=sys.stderr,
        )
        return 2
    try:
        shape = load_model_shape(args.model)
    except ModelShapeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    missing = [str(p) for p in args.metrics if not p.is_file()]
    if missing:
        print(f"error: no such metrics file: {', '.join(missing)}", file=sys.stderr)
        return 2
    flops_per_s, bytes_per_s = measure_ceilings() if args.measure else (args.tflops * 1e12, args.tbps * 1e12)
    results = []
    for path in args.metrics:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        results += rows_for(path.parent.name, records, shape, flops_per_s, bytes_per_s, args.optimizer_steps, args.n)
    print(f"ceilings: {flops_per_s / 1e12:.0f} TFLOP/s bf16 matmul, {bytes_per_s / 1e12:.2f} TB/s device copy")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"tflops": flops_per_s / 1e12, "tbps": bytes_per_s / 1e12, "steps": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
