"""The compiled RMSNorm over every layout a ``grpo train`` run feeds it stays within torch.compile's graph limit.

On GPUs ``fused.rms_norm`` runs ``fused.compiled_rms_norm``; here the same function runs on CPU tensors (inductor
compiles for the CPU too), so the graphs dynamo keeps for ``_rms_norm`` can be counted. Before rows were flattened,
these calls took all 8 graphs (the last for a stride) and torch ran the rest eagerly.
"""

import torch
import torch._dynamo

from grpo_core.models import fused

H, D = 64, 16  # hidden size, head size (Qwen3's q/k norms)


def _calls():
    """(x, weight, grad) for each layout of a run: the actor's padded [s, b, h] and packed [t, 1, h] micro-batches
    (training with grad, log-probs without), the engine's prefill [u, P, h], decode [b, 1, h] at shrinking batches,
    the last-token slice, Qwen3's transposed q/k, and one row."""
    train_w = torch.randn(H, requires_grad=True)
    engine_w, head_w = torch.randn(H), torch.randn(D)
    for s, b in ((300, 16), (287, 16), (310, 5)):
        yield torch.randn(s, b, H, requires_grad=True), train_w, True
        yield torch.randn(s, b, H), train_w, False
    for t in (4000, 3517):
        yield torch.randn(t, 1, H, requires_grad=True), train_w, True
        yield torch.randn(t, 1, H), train_w, False
    for u, p in ((64, 120), (64, 93)):
        yield torch.randn(u, p, H), engine_w, False
        yield torch.randn(u, p, H)[:, -1], engine_w, False
        yield torch.randn(u, p, 4, D).transpose(1, 2), head_w, False
    for b in (512, 256, 1):
        yield torch.randn(b, 1, H), engine_w, False


def _graphs(fn) -> int:
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


def test_rms_norm_graphs_stay_under_the_recompile_limit():
    torch._dynamo.reset()
    for x, weight, grad in _calls():
        with torch.set_grad_enabled(grad):
            out = fused.compiled_rms_norm(x, weight, 1e-6)
            ref = fused._rms_norm(x, weight, 1e-6)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        if grad:
            g = torch.randn_like(ref)
            torch.testing.assert_close(
                torch.autograd.grad(out, (x, weight), g), torch.autograd.grad(ref, (x, weight), g), atol=1e-4, rtol=1e-4
            )
    # forward: every layout and grad mode in one graph, plus a single row (0/1 specialisation) and the head size
    assert _graphs(fused._rms_norm) <= 3 < torch._dynamo.config.recompile_limit
    # backward: one graph (it reduces over the hidden size only)
    assert _graphs(fused._rms_norm_back) == 1


def test_rms_norm_backward_in_bf16_matches_autograd():
    """bf16 as on the GPU: the hand-written backward against autograd through ``_rms_norm`` in fp32."""
    x = torch.randn(37, 3, H, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(H, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(37, 3, H, dtype=torch.bfloat16)
    g_x, g_w = fused._rms_norm_back(g.reshape(-1, H), x.detach().reshape(-1, H), weight.detach(), 1e-6)
    g_w = g_w.sum(0)
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref_x, ref_w = torch.autograd.grad(fused._rms_norm(x32, w32, 1e-6), (x32, w32), g.float())
    torch.testing.assert_close(g_x.float().reshape(x.shape), ref_x, atol=0.05, rtol=0.02)
    torch.testing.assert_close(g_w.float(), ref_w, atol=0.5, rtol=0.02)


def test_rms_norm_inside_another_compiled_function():
    """The engine's compiled blocks call it: there it is traced into their graph (marking dims is not allowed)."""
    torch._dynamo.reset()
    x, weight = torch.randn(6, 1, H), torch.randn(H)
    block = torch.compile(lambda x, w: fused.compiled_rms_norm(x, w, 1e-6) * 2)
    torch.testing.assert_close(block(x, weight), 2 * fused._rms_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_engine_rope_takes_a_graph_for_prefill_and_one_for_decode():
    """The engine's RoPE (queries and keys rotated, values copied) against megatron's per-call form, compiled over
    the engine's layouts: prefill [u, heads, P, d] at several widths and decode [b, heads, 1, d] at several batches."""
    torch._dynamo.reset()
    heads, rotated = 8, 6  # 4 query and 2 key heads rotated, 2 value heads copied
    for b, s in ((64, 120), (64, 93), (48, 77), (512, 1), (256, 1), (3, 1)):
        t = torch.randn(b, s, heads, D).transpose(1, 2)
        angles = torch.rand(b, 1, s, D) * 50
        out = fused.compiled_rope(t, angles.cos(), angles.sin(), rotated)
        torch.testing.assert_close(out[:, :rotated], fused._rope(t[:, :rotated], angles), atol=1e-5, rtol=1e-5)
        assert torch.equal(out[:, rotated:], t[:, rotated:])
    assert _graphs(fused._rope_heads) <= 2


def test_split_rope_compiled_matches_eager_in_a_graph_for_packed_and_one_for_padded():
    """The QKV split and RoPE as the GPU runs it (compiled, tokens symbolic), forward and backward, against its eager
    form over a run's layouts: packed micro-batches [t, 1, groups, width] of several lengths and padded [s, b, ...]."""
    torch._dynamo.reset()
    groups, per_group = 2, 3
    for s, b in ((300, 1), (287, 1), (40, 4), (37, 3)):
        mixed = torch.randn(s, b, groups, (per_group + 2) * D, requires_grad=True)
        angles = torch.rand(s, 1, 1, D) * 50
        cos, sin = angles.cos(), angles.sin()
        eager = fused._split_rope(mixed, cos, sin, per_group)
        compiled = fused._split_rope_compiled(
            fused.token_dims(mixed, 0, 1), fused.token_dims(cos, 0), fused.token_dims(sin, 0), per_group
        )
        grads = [torch.randn_like(t) for t in eager]
        for a, e in zip(compiled, eager, strict=True):
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            torch.autograd.grad(compiled, mixed, grads)[0], torch.autograd.grad(eager, mixed, grads)[0]
        )
    assert _graphs(fused._split_rope) <= 2
