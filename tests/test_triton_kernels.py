"""The project's Triton kernels on this CPU, run by Triton's interpreter: the static engine's cascade decode attention
(``rollout/decode_attention.py``) against each row's own softmax and the whole engine against its SDPA path; the
log-prob's logits gradient (``actor/logprobs.py``) against the function it replaces on GPUs.

Triton reads ``TRITON_INTERPRET`` when it is imported, so the tests run in a pytest of their own with it set
(``test_in_triton_s_interpreter``); in this process they are skipped. What they cannot say is the kernels' speed on
a GPU (BENCHMARKS.md).
"""

import os
import subprocess
import sys

import pytest
import torch

from grpo_core.rollout import SamplingSettings, decode_attention
from tests.test_rollout_static import PROMPTS, engine_for, tiny

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETER, reason="run by test_in_triton_s_interpreter")


@pytest.mark.skipif(INTERPRETER, reason="the pytest this starts")
def test_in_triton_s_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert "4 passed" in run.stdout  # the interpreted tests ran (this one skips itself there)


@pytest.mark.skipif(INTERPRETER, reason="the pytest this starts")
def test_the_engine_picks_its_attention(tmp_path):
    """auto: SDPA where no CUDA graph replays the step (here); the cascade only for head sizes its kernels take."""
    import dataclasses

    from grpo_core.rollout.static import StaticEngine

    _, shape = tiny("qwen2", tmp_path)
    assert not StaticEngine(shape, [2], "float32", max_model_len=64).cascade
    with pytest.raises(ValueError, match="use auto, cascade or sdpa"):
        StaticEngine(shape, [2], "float32", max_model_len=64, attention="flash")
    if decode_attention.triton is not None:
        with pytest.raises(ValueError, match="power-of-two head size, not 24"):
            StaticEngine(dataclasses.replace(shape, head_dim=24), [2], "float32", attention="cascade")


@interpreted
def test_cascade_attention_matches_each_rows_own_softmax():
    """Prompts left-padded to a width, rows of a prompt holding the same prompt keys (anything before a row's start),
    grouped heads, a query tile split over programs (8 rows x 24 heads a prompt > 128), the first response slot."""
    from grpo_core.rollout.decode_attention import cascade_attention

    torch.manual_seed(0)
    for u, n, heads, kv_heads, d, width, slot in ((3, 4, 4, 2, 16, 150, 300), (2, 8, 24, 1, 32, 40, 40)):
        rows = u * n
        cache = torch.randn(rows, 2 * kv_heads, 400, d)
        start = torch.randint(0, width, (u,)).repeat_interleave(n)
        for j in range(u):
            cache[j * n + 1 : (j + 1) * n, :, :width] = cache[j * n, :, :width]
        q = torch.randn(rows, heads + 2 * kv_heads, d)[:, :heads]  # a strided view, as the engine's
        got = cascade_attention(q, cache, start, torch.tensor([width]), torch.tensor([slot]), n, 200)
        group = heads // kv_heads
        for r in range(rows):
            seen = torch.arange(int(start[r]), slot + 1)
            keys = cache[r, :kv_heads, seen].repeat_interleave(group, 0)
            values = cache[r, kv_heads:, seen].repeat_interleave(group, 0)
            weights = torch.softmax(q[r, :, None] @ keys.transpose(1, 2) * d**-0.5, -1)
            torch.testing.assert_close(got[r], (weights @ values)[:, 0], atol=1e-5, rtol=1e-5)


@interpreted
def test_the_cascade_engine_generates_what_the_sdpa_one_does(tmp_path):
    """The whole engine with the cascade (prompt keys written to, and read from, a prompt's first row only) against
    SDPA over every row's cache: greedy tokens and log-probs, samples of a prompt and one sample each."""
    model, shape = tiny("qwen2", tmp_path)
    for n in (2, 1):
        settings = SamplingSettings(n=n, temperature=0.0, max_new_tokens=12)
        sdpa = engine_for(model, shape, stop_ids=[511], max_batch_size=6, attention="sdpa").generate(PROMPTS, settings)
        engine = engine_for(model, shape, stop_ids=[511], max_batch_size=6, attention="cascade")
        cascade = engine.generate(PROMPTS, settings)
        assert engine.cascade and cascade.response_ids == sdpa.response_ids
        for got, want in zip(cascade.response_log_probs, sdpa.response_log_probs, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)


@interpreted
def test_the_logits_gradient_kernel_gives_what_the_compiled_function_does():
    """Rows wider than the columns (a row stride), TP padding columns, labels on another rank (-1), several column
    blocks, fp32 and bf16, with and without the entropy term."""
    from grpo_core.actor.logprobs import _logits_grad, _logits_grad_triton

    torch.manual_seed(0)
    for columns, real, dtype, entropy_grad in ((50, 50, torch.float32, True), (300, 290, torch.bfloat16, True),
                                               (5000, 4990, torch.float32, False)):  # fmt: skip
        tokens = 7
        logits = (torch.randn(tokens, columns + 3) * 3).to(dtype)[:, :columns]
        labels = torch.randint(-1, real, (tokens,))
        log_p = torch.log_softmax(logits[:, :real].float(), -1)
        row_max = logits[:, :real].float().amax(-1)
        log_z = torch.logsumexp(logits[:, :real].float() - row_max[:, None], -1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        args = (logits, labels, row_max, log_z, entropy, torch.randn(tokens), torch.randn(tokens), real, entropy_grad)
        got, want = _logits_grad_triton(*args), _logits_grad(*args)
        assert got.dtype == dtype and got.shape == (tokens, columns)
        tolerance = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-5, rtol=1.6e-2)
        torch.testing.assert_close(got, want, **tolerance)
        assert not got[:, real:].any()  # padding columns get no gradient


@interpreted
def test_the_softmax_sums_kernel_gives_what_the_two_passes_do():
    """One read with a running max against the max, then the sums: TP padding columns, a max in a later block of
    columns (the running sums rescaled), bf16, and a rank of padding only."""
    from grpo_core.actor.logprobs import PAD_LOGIT, _exp_sums, _row_max, _softmax_sums_triton

    torch.manual_seed(0)
    for columns, real, dtype in ((50, 50, torch.float32), (300, 290, torch.bfloat16), (9000, 8990, torch.float32)):
        logits = (torch.randn(5, columns + 3) * 3).to(dtype)[:, :columns]
        logits[1, 8500 % columns] = 30.0  # the row's max, past the first block where there are two
        got = _softmax_sums_triton(logits, real)
        row_max = _row_max(logits, real)
        torch.testing.assert_close(got[0], row_max)
        torch.testing.assert_close(got[1:], _exp_sums(logits, row_max, real).T, atol=1e-5, rtol=1e-5)
    padding_only = _softmax_sums_triton(logits, 0)
    assert (padding_only[0] == PAD_LOGIT).all() and not padding_only[1:].any()
