"""Sequence packing in the actor on GRPO-shaped rows: padded vs packed vs packed with a token budget, and
a Hugging Face training step on the same padded rows, per GPU, random weights, bf16.

    torchrun --standalone --nproc-per-node 1 bench/packing.py --model Qwen/Qwen2.5-1.5B

Rows as a GRPO step makes them: prompts of --prompt-min..--prompt-max tokens left-padded to the longest,
responses of --response-min..--response-max tokens right-padded to --response-max (the lengths of a
policy part-way through GSM8K training, where some responses stop early and some run to the limit).
Tokens/s count real tokens only. Also reports how far packed log-probs are from padded ones (bf16:
different kernels, so not bit-equal; they are in fp32, tests/test_actor.py).
"""

import argparse
import dataclasses
import json

import torch
from actor_step import timed  # bench/ is on sys.path when this file runs


def grpo_rows(args, vocab: int):
    from grpo_core.data.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(args.prompt_min, args.prompt_max + 1, (args.rows,), generator=g)
    responses = torch.randint(args.response_min, args.response_max + 1, (args.rows,), generator=g)
    width, r = int(prompts.max()), args.response_max
    cols = torch.arange(width + r)
    attention = ((cols >= width - prompts[:, None]) & (cols < width + responses[:, None])).long()
    ids = torch.randint(0, vocab, attention.shape, generator=g) * attention
    mask = attention[:, width:].float()
    advantages = torch.randn(args.rows, 1, generator=g) * mask
    return RolloutBatch(ids, attention, mask, advantages=advantages)


def flops(shape, lengths: torch.Tensor) -> float:
    """6 N per token plus causal attention 6 L h s per token, for each row at its own length s."""
    n, attn = 6 * shape.active_params, 6 * shape.num_layers * shape.hidden_size
    return float((lengths * (n + attn * lengths)).sum())


def megatron(args, shape, batch) -> dict:
    from grpo_core.actor.actor import ActorSettings, MegatronActor
    from grpo_core.actor.loss import LossSettings
    from grpo_core.actor.parallel import init_distributed, init_model_parallel
    from grpo_core.planning.layout import ParallelLayout

    init_distributed()
    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=1)
    base = ActorSettings(
        layout=layout,
        dtype="bfloat16",
        mini_batch_rows=args.rows,
        micro_batch_rows=args.micro_batch,
        loss=LossSettings(kl_loss_coef=0.001),
    )
    policy = MegatronActor(shape, base, hf_path=None)
    variants = {
        "padded": base,
        "packed": dataclasses.replace(base, pack_sequences=True),
        "packed, token budget": dataclasses.replace(
            base, pack_sequences=True, micro_batch_tokens=args.micro_batch * batch.input_ids.shape[1]
        ),
    }
    log_probs = {}  # first, before any update moves the weights
    for name, settings in variants.items():
        policy.s = settings
        log_probs[name] = policy.compute_log_prob(batch, micro_batch_tokens=settings.micro_batch_tokens)[0]
    batch.old_log_probs = batch.ref_log_probs = log_probs["padded"]
    real = batch.response_mask.bool()
    out = {}
    for name, settings in variants.items():
        policy.s = settings
        torch.cuda.reset_peak_memory_stats()
        diff = (log_probs[name] - log_probs["padded"]).abs()[real]
        out[name] = {
            "fwd_bwd_s": timed(lambda: policy.forward_backward(batch), args.warmup, args.steps),
            "update_s": timed(lambda: policy.update(batch), 1, args.steps),
            "log_prob_s": timed(
                lambda tokens=settings.micro_batch_tokens: policy.compute_log_prob(batch, micro_batch_tokens=tokens),
                1,
                args.steps,
            ),
            "log_prob_diff_mean": diff.mean().item(),
            "log_prob_diff_max": diff.max().item(),
            "micro_batches": len(policy._micro_batches(batch, settings.micro_batch_rows, settings.micro_batch_tokens)),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
    return out


def hugging_face(args, batch) -> dict:
    from transformers import AutoModelForCausalLM

    from grpo_core.models.known_configs import transformers_config

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            transformers_config(args.model), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids, attention = batch.input_ids.cuda(), batch.attention_mask.cuda()
    labels = ids.masked_fill(attention == 0, -100)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        for i in range(0, ids.shape[0], args.micro_batch):
            rows = slice(i, i + args.micro_batch)
            model(input_ids=ids[rows], attention_mask=attention[rows], labels=labels[rows]).loss.backward()

    def update():
        fwd_bwd()
        optimizer.step()

    result = {"fwd_bwd_s": timed(fwd_bwd, args.warmup, args.steps), "update_s": timed(update, 1, args.steps)}
    result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=80)
    p.add_argument("--prompt-max", type=int, default=230)
    p.add_argument("--response-min", type=int, default=32)
    p.add_argument("--response-max", type=int, default=512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="packing.json")
    args = p.parse_args()

    from grpo_core.models.shape import load_model_shape

    shape = load_model_shape(args.model)
    batch = grpo_rows(args, shape.vocab_size)
    lengths = batch.attention_mask.sum(1)
    real_tokens, total_flops = int(lengths.sum()), flops(shape, lengths)
    results = {"hf (padded)": hugging_face(args, batch)}
    torch.cuda.empty_cache()  # the HF model is gone with its function
    results |= megatron(args, shape, batch)
    for r in results.values():
        for phase in ("fwd_bwd", "update", "log_prob"):
            if f"{phase}_s" in r:
                r[f"{phase}_tokens_per_s"] = real_tokens / r[f"{phase}_s"]
        r["fwd_bwd_tflops"] = total_flops / r["fwd_bwd_s"] / 1e12
    summary = {
        "model": args.model,
        "rows": args.rows,
        "padded_shape": list(batch.input_ids.shape),
        "real_tokens": real_tokens,
        "padding_share": 1 - real_tokens / batch.input_ids.numel(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"\n{args.model}: {args.rows} rows {tuple(batch.input_ids.shape)}, {real_tokens:,} real tokens "
        f"({summary['padding_share']:.0%} padding), micro-batch {args.micro_batch} rows"
    )
    print(
        "| variant | micro-batches | fwd+bwd tok/s | TFLOP/s | update tok/s | log-prob tok/s | lp diff mean / max "
        "| peak GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        lp = f"{r['log_prob_tokens_per_s']:,.0f}" if "log_prob_s" in r else "-"
        diff = f"{r['log_prob_diff_mean']:.1e} / {r['log_prob_diff_max']:.1e}" if "log_prob_diff_max" in r else "-"
        print(
            f"| {name} | {r.get('micro_batches', args.rows // args.micro_batch)} | {r['fwd_bwd_tokens_per_s']:,.0f} "
            f"| {r['fwd_bwd_tflops']:.0f} | {r['update_tokens_per_s']:,.0f} | {lp} | {diff} | {r['peak_mem_gib']:.1f} |"
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
