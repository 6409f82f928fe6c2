"""The log-prob's two passes over the logits on one GPU, each Triton kernel (``actor/logprobs.py``) against the
compiled form it replaced, at update and log-prob micro-batch sizes (bf16 logits, Qwen2.5's 151,936 columns), with
the time their bytes alone take at the copy bandwidth measured here: the forward's softmax sums (one read of the
logits; compiled, a max pass and a sums pass) and the backward's gradient (a read and a write).

    python bench/logits_grad.py [--tokens 8192 16384 32768] [--columns 151936]
"""

import argparse

import torch
from cuda_timing import copy_tbps, ms

from grpo_core.actor.logprobs import (
    _exp_sums,
    _kernel,
    _logits_grad,
    _logits_grad_triton,
    _row_max,
    _softmax_sums_triton,
)


def compiled_sums(logits: torch.Tensor, real: int) -> torch.Tensor:
    row_max = _kernel(_row_max, logits, real)
    return torch.cat((row_max[None], _kernel(_exp_sums, logits, row_max, real).T))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--columns", type=int, default=151936)
    args = p.parse_args()
    copy = copy_tbps()
    print("| pass | tokens | compiled ms | Triton ms | bytes' time ms | max difference |\n|" + " --- |" * 6)
    for tokens in args.tokens:
        torch.manual_seed(0)
        logits = torch.randn(tokens, args.columns, device="cuda", dtype=torch.bfloat16) * 3
        read_ms = logits.numel() * logits.element_size() / copy / 1e9
        sums = (compiled_sums, _softmax_sums_triton, (logits, args.columns), read_ms)
        row_max, sum_exp, sum_es = compiled_sums(logits, args.columns)
        labels = torch.randint(0, args.columns, (tokens,), device="cuda")
        entropy = sum_exp.log() - sum_es / sum_exp
        g = torch.randn(tokens, device="cuda"), torch.randn(tokens, device="cuda")
        grad_args = (logits, labels, row_max, sum_exp.log(), entropy, *g, args.columns, False)
        grad = (lambda *a: _kernel(_logits_grad, *a), _logits_grad_triton, grad_args, 2 * read_ms)
        for name, (old, new, call, bytes_ms) in (("sums", sums), ("gradient", grad)):
            diff = (old(*call).float() - new(*call).float()).abs().max().item()
            print(f"| {name} | {tokens} | {ms(old, *call):.2f} | {ms(new, *call):.2f} | {bytes_ms:.2f} | {diff:.1e} |")
        del logits, sums, grad, grad_args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
