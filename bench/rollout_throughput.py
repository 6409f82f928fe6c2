"""Rollout tokens/s on one GPU: the static engine vs ``transformers.generate``, same model, same prompts.

    python bench/rollout_throughput.py --model Qwen/Qwen2.5-1.5B --prompts 256 --n 8 --out rollout.json

Random weights of the model's config (bf16), random prompts of 64-192 tokens, ``--n`` samples each at
temperature 1, exactly ``--new-tokens`` new tokens per sample (no stop token can end one early), so
both sides generate the same number of tokens. For each ``--max-num-seqs`` B, ``transformers.generate``
(SDPA, dynamic cache) runs B rows (B / n prompts) in one call, and the engine, its cache sized for B rows,
runs the same prompts and then all ``--prompts`` (B rows at a time). Prints a table last, writes JSON.
"""

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--out", default="rollout.json")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from grpo_core.models.known_configs import transformers_config
    from grpo_core.models.shape import load_model_shape
    from grpo_core.rollout.base import SamplingSettings
    from grpo_core.rollout.static import StaticEngine

    shape, config = load_model_shape(args.model), transformers_config(args.model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 193, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(0, shape.vocab_size, (n,), generator=g).tolist() for n in lengths]
    settings = SamplingSettings(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    rows = []

    def record(name: str, n_prompts: int, seconds: float, **extra) -> None:
        tokens = n_prompts * args.n * args.new_tokens
        rows.append(
            {
                "engine": name,
                "prompts": n_prompts,
                "samples": n_prompts * args.n,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                **extra,
            }
        )

    def hf_generate(model, chosen: list[list[int]]) -> float:
        """transformers.generate on one left-padded batch, n samples per prompt, each exactly new_tokens long."""
        width = max(len(q) for q in chosen)
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, q in enumerate(chosen):
            ids[i, width - len(q) :], mask[i, width - len(q) :] = torch.tensor(q), 1
        kwargs = dict(
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_return_sequences=args.n,
            pad_token_id=0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), **kwargs)
        torch.cuda.synchronize()
        assert out.shape[1] == width + args.new_tokens
        return time.perf_counter() - start

    hf_generate(model, prompts[:2])  # warm-up
    for seqs in args.max_num_seqs:
        chosen = prompts[: seqs // args.n]
        torch.cuda.reset_peak_memory_stats()
        record(
            "transformers.generate",
            len(chosen),
            hf_generate(model, chosen),
            peak_gib=torch.cuda.max_memory_allocated() / 2**30,
        )
    weights = dict(model.state_dict())
    del model
    torch.cuda.empty_cache()

    max_len = max(lengths) + args.new_tokens
    for seqs in args.max_num_seqs:
        torch.cuda.reset_peak_memory_stats()
        engine = StaticEngine(shape, [-1], dtype="bfloat16", device="cuda", max_batch_size=seqs, max_model_len=max_len)
        engine.update_weights(weights.items())
        for chosen in (prompts[: seqs // args.n], prompts):
            engine.generate(chosen, settings)  # steady state: graphs captured, kernels compiled for these shapes
            torch.cuda.synchronize()
            start = time.perf_counter()
            gen = engine.generate(chosen, settings)
            torch.cuda.synchronize()
            assert all(len(r) == args.new_tokens for r in gen.response_ids)
            record(
                f"static, max_num_seqs={seqs}",
                len(chosen),
                time.perf_counter() - start,
                batch=seqs,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30,
            )
        del engine
        torch.cuda.empty_cache()

    result = {"model": args.model, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    generate = {r["samples"]: r["tokens_per_s"] for r in rows if r["engine"] == "transformers.generate"}
    print(f"\n{args.model}, n={args.n}, {args.new_tokens} new tokens, prompts 64-192 tokens")
    print("| engine | prompts x n | seconds | tokens/s | vs generate at the same batch | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        batch = r.get("batch", r["samples"])
        print(
            f"| {r['engine']} | {r['prompts']} x {args.n} | {r['seconds']:.1f} | {r['tokens_per_s']:,.0f} "
            f"| {r['tokens_per_s'] / generate[batch]:.1f}x | {r['peak_gib']:.1f} |"
        )


if __name__ == "__main__":
    main()
