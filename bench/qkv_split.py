"""megatron's QKV split and RoPE against ``fused.split_rope`` on one GPU, forward and forward + backward, on packed
sequences of a Qwen2.5-1.5B layer's shape (12 query heads over 2 KV heads of 128, bf16), with the time the fused
form's bytes alone take at the copy bandwidth measured here. megatron's path as a ``grpo train`` run takes it: its
split (views), the query reshape (a copy), then the compiled RoPE hooks for the queries and the keys.

    python bench/qkv_split.py [--tokens 8192 16384 32768] [--sequence 360]
"""

import argparse

import torch
from cuda_timing import copy_tbps, ms

from grpo_core.models import fused


def megatrons(mixed: torch.Tensor, freqs: torch.Tensor, cu: torch.Tensor, per_group: int, d: int):
    query, key, value = torch.split(mixed, [per_group * d, d, d], dim=3)
    query = query.reshape(query.shape[0], 1, -1, d)
    query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
    return fused._rope_thd(query, cu, freqs), fused._rope_thd(key, cu, freqs), value


def ours(mixed: torch.Tensor, freqs: torch.Tensor, cu: torch.Tensor, per_group: int, d: int):
    return tuple(t.squeeze(1) for t in fused.split_rope(mixed, freqs, per_group, cu))


def forward(fn, mixed, *args):
    with torch.no_grad():
        return fn(mixed, *args)


def forward_backward(grads, fn, mixed, *args):
    return torch.autograd.grad(fn(mixed, *args), mixed, grads)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--sequence", type=int, default=360, help="packed sequence length")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    fused.install_fused_rope()
    copy = copy_tbps()
    print("| tokens | pass | megatron ms | fused ms | bytes' time ms | max difference |\n|" + " --- |" * 6)
    d, per_group = args.head_dim, args.per_group
    for tokens in args.tokens:
        torch.manual_seed(0)
        width = (per_group + 2) * d
        mixed = torch.randn(tokens, 1, args.groups, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        freqs = torch.rand(args.sequence, 1, 1, d, device="cuda") * 100
        cu = torch.arange(0, tokens + args.sequence, args.sequence, device="cuda").clamp(max=tokens).int()
        io_ms = 2 * mixed.numel() * mixed.element_size() / copy / 1e9  # read it once, write q, k, v once
        outputs = {name: fn(mixed, freqs, cu, per_group, d) for name, fn in (("megatron", megatrons), ("fused", ours))}
        grads = [torch.randn_like(t) for t in outputs["fused"]]
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(*outputs.values(), strict=True))
        g_meg, g_ours = (torch.autograd.grad(outputs[n], mixed, grads)[0] for n in ("megatron", "fused"))
        grad_diff = (g_meg.float() - g_ours.float()).abs().max().item()
        timings = []  # (forward, forward + backward) ms of megatron's path, then of the fused one
        for fn in (megatrons, ours):
            call = (fn, mixed, freqs, cu, per_group, d)
            timings.append((ms(forward, *call), ms(forward_backward, grads, *call)))
        (f_meg, b_meg), (f_ours, b_ours) = timings
        print(f"| {tokens} | forward | {f_meg:.3f} | {f_ours:.3f} | {io_ms:.3f} | {diff:.1e} |")
        print(f"| {tokens} | forward + backward | {b_meg:.3f} | {b_ours:.3f} | {2 * io_ms:.3f} | {grad_diff:.1e} |")


if __name__ == "__main__":
    main()
