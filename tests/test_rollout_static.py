"""The static-cache engine against transformers on tiny random Llama / Qwen2 / Qwen3 models (fp32, CPU).

On a CPU the decode step runs eagerly (bf16 with packed weights: compiled, tested here against the eager step); on
a GPU the same step is replayed as a CUDA graph (bench/static_engine_gpu.py checks it on a lent GPU: CI has none).
"""

import json
import os
from pathlib import Path

import pytest
import torch

from grpo_core.models.shape import load_model_shape
from grpo_core.rollout import SamplingSettings
from tests.test_rollout_hf import teacher_forced


def tiny(kind: str, tmp_path):
    """A random 2-layer model of ``kind``, saved (so its shape is read the way the trainer reads it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,  # peaked distributions: greedy ties are unlikely
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
        with torch.no_grad():  # random QKV biases, so a bias mapped to the wrong slice shows
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, head_dim=16, **common))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(tmp_path / kind)
    return model, load_model_shape(str(tmp_path / kind))


def engine_for(model, shape, stop_ids=(2,), **kwargs):
    from grpo_core.rollout.static import StaticEngine

    engine = StaticEngine(shape, list(stop_ids), dtype="float32", max_model_len=128, **kwargs)
    engine.update_weights(model.state_dict().items())
    return engine


REPO = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 17, 33, 250, 7], [9, 100], [44, 45, 46, 47, 48, 49, 50, 51, 52]]  # left padding matters


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_generate(kind, tmp_path):
    model, shape = tiny(kind, tmp_path)
    engine = engine_for(model, shape, max_batch_size=4)  # 3 prompts x 2 samples: chunks of 2 and 1 prompts
    gen = engine.generate(PROMPTS, SamplingSettings(n=2, temperature=0.0, max_new_tokens=12))
    assert gen.group_index == [0, 0, 1, 1, 2, 2]
    for row, response in enumerate(gen.response_ids):
        prompt = PROMPTS[gen.group_index[row]]
        with torch.no_grad():
            expected = model.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert response == expected[: len(response)]
        assert len(response) == len(expected) or response[-1] == 2
        torch.testing.assert_close(
            torch.tensor(gen.response_log_probs[row]), teacher_forced(model, prompt, response), atol=1e-4, rtol=0
        )


def test_attended_length_grows_with_the_written_slots(tmp_path, monkeypatch):
    """With 4-slot buckets a chunk's decode steps cross several lengths; greedy tokens and log-probs are
    those of the default bucket (64: at most two lengths over the 128-slot cache) and the model's.
    Without ``grow_length`` every step of a chunk attends over the chunk's whole length, same tokens."""
    from grpo_core.rollout import static

    model, shape = tiny("qwen2", tmp_path)
    settings = SamplingSettings(n=2, temperature=0.0, max_new_tokens=20)
    whole = engine_for(model, shape, stop_ids=[511], max_batch_size=4).generate(PROMPTS, settings)

    attended = []  # (slot written, length attended) of each decode step
    decode = static.StaticEngine._decode

    def recording(self, st, mode, length, rows_per_prompt):
        attended.append((int(st["slot"]), length))
        decode(self, st, mode, length, rows_per_prompt)

    monkeypatch.setattr(static, "LENGTH_BUCKET", 4)
    monkeypatch.setattr(static.StaticEngine, "_decode", recording)
    engine = engine_for(model, shape, stop_ids=[511], max_batch_size=4)
    gen = engine.generate(PROMPTS, settings)

    # chunks: prompts 0 and 1 (left-padded to 5), then prompt 2 (9); 19 decode steps each
    slots = [*range(5, 24), *range(9, 28)]
    parts = engine.take_timings()  # the loop logs these beside timing/gen
    assert parts.pop("rollout/decode_steps") == 38 and engine.take_timings() == {}
    assert sorted(parts) == [f"rollout/{p}_s" for p in ("capture", "collect", "decode", "prefill")]
    assert all(seconds > 0 for seconds in parts.values())
    assert attended == [(slot, (slot // 4 + 1) * 4) for slot in slots]  # slot + 1 rounded up to 4
    assert [length for _, length in attended[:19]] == [8] * 3 + [12] * 4 + [16] * 4 + [20] * 4 + [24] * 4
    assert gen.response_ids == whole.response_ids
    assert all(len(response) == 20 for response in gen.response_ids)  # no stop token: every step compared
    for row, response in enumerate(gen.response_ids):
        log_probs = torch.tensor(gen.response_log_probs[row])
        torch.testing.assert_close(log_probs, torch.tensor(whole.response_log_probs[row]), atol=1e-5, rtol=0)
        expected = teacher_forced(model, PROMPTS[gen.group_index[row]], response)
        torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)

    attended.clear()
    fixed = engine_for(model, shape, stop_ids=[511], max_batch_size=4, grow_length=False).generate(PROMPTS, settings)
    assert attended == [(slot, 24) for slot in range(5, 24)] + [(slot, 28) for slot in range(9, 28)]
    assert fixed.response_ids == whole.response_ids


def test_sampling_log_probs_seed_and_groups(tmp_path):
    model, shape = tiny("qwen2", tmp_path)
    engine = engine_for(model, shape, max_batch_size=8)
    settings = SamplingSettings(n=4, temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=10, seed=3)
    gen = engine.generate(PROMPTS, settings)
    assert len(gen.response_ids) == 12
    for row, response in enumerate(gen.response_ids):
        # the model's own temperature-1 log-probs, whatever the sampling settings
        expected = teacher_forced(model, PROMPTS[gen.group_index[row]], response)
        torch.testing.assert_close(torch.tensor(gen.response_log_probs[row]), expected, atol=1e-4, rtol=0)
    assert len({tuple(r) for r in gen.response_ids[:4]}) > 1  # a prompt's samples differ
    assert engine.generate(PROMPTS, settings).response_ids == gen.response_ids  # the seed fixes them


def test_top_k_one_is_greedy(tmp_path):
    model, shape = tiny("llama", tmp_path)
    engine = engine_for(model, shape)
    greedy = engine.generate(PROMPTS, SamplingSettings(n=1, temperature=0.0, max_new_tokens=8))
    top1 = engine.generate(PROMPTS, SamplingSettings(n=3, temperature=1.0, top_k=1, max_new_tokens=8))
    assert top1.response_ids == [r for r in greedy.response_ids for _ in range(3)]


@pytest.mark.parametrize("sampler", ["inverse_cdf", "sample_on_cpu"])
def test_inverse_cdf_draws_each_token_at_its_probability_and_never_a_masked_or_padded_one(sampler):
    """300 columns: two full blocks of 128 and a padded one of 44; ten masked. Pearson's chi-square of
    400,000 draws over the 289 free columns stays under 380 (p < 0.001 for 289 degrees of freedom). The GPU's
    ``inverse_cdf`` and the CPU's ``sample_on_cpu`` (at temperature 1)."""
    from grpo_core.rollout import sampler
    from grpo_core.rollout.sampler import SAMPLE_BLOCK

    def inverse_cdf(logits):
        if sampler == "inverse_cdf":
            return sampler.inverse_cdf(logits)
        return sampler.sample_on_cpu(logits, torch.tensor(1.0), False, -1, 1.0)[0]

    assert SAMPLE_BLOCK == 128
    torch.manual_seed(0)
    logits = torch.randn(300) * 2
    logits[50:60] = float("-inf")
    probs = logits.softmax(-1)
    n = 400_000
    counts = torch.bincount(inverse_cdf(logits.expand(n, 300).contiguous()), minlength=300).float()
    assert counts.numel() == 300 and counts[50:60].sum() == 0  # nothing past the vocabulary, nothing masked
    free = probs > 0
    expected = n * probs[free]
    assert ((counts[free] - expected) ** 2 / expected).sum() < 380
    # a row whose only token is the last column (a block of its own), and one whose only token is early
    only = torch.full((3, 257), float("-inf"))
    only[0, 256] = only[1, 3] = only[2, 128] = 0.0
    assert inverse_cdf(only).tolist() == [256, 3, 128]


def test_the_cpu_sampler_draws_what_the_gpu_one_does():
    """``sample_on_cpu`` (masses from softmax) against ``sample`` (from ``block_stats``; compiled on GPUs), both
    eager here: from the same random numbers the same tokens (a draw lands on another token only where the two
    masses round apart), the same temperature-1 log-probs, at temperature 1 and with temperature, top-k and top-p;
    greedy alike."""
    from grpo_core.rollout.sampler import sample, sample_on_cpu

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 1000, generator=g) * 3).to(torch.bfloat16)  # a padded last block (1000 = 7 x 128 + 104)
    for temperature, top_k, top_p, greedy in ((1.0, -1, 1.0, False), (0.7, 50, 0.9, False), (1.0, -1, 1.0, True)):
        draws = []
        for draw in (sample, sample_on_cpu):
            torch.manual_seed(1)
            draws.append(draw(logits, torch.tensor(temperature), greedy, top_k, top_p))
        (want_tokens, want_log_probs), (tokens, log_probs) = draws
        assert (tokens == want_tokens).float().mean() >= 0.98
        same = tokens == want_tokens
        torch.testing.assert_close(log_probs[same], want_log_probs[same], atol=1e-5, rtol=0)


def test_a_stop_token_ends_the_response(tmp_path):
    model, shape = tiny("llama", tmp_path)
    free = engine_for(model, shape, stop_ids=[511]).generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=8))
    stop = free.response_ids[0][3]
    gen = engine_for(model, shape, stop_ids=[stop]).generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=8))
    first = free.response_ids[0].index(stop)
    assert gen.response_ids[0] == free.response_ids[0][: first + 1]
    assert gen.finish_reasons[0] == "stop"
    assert len(gen.response_log_probs[0]) == first + 1


def test_weight_updates_and_errors(tmp_path):
    model, shape = tiny("llama", tmp_path)
    engine = engine_for(model, shape)
    before = engine.generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=6)).response_log_probs
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # tied: the lm_head changes with it
    engine.update_weights([("model.embed_tokens.weight", model.model.embed_tokens.weight)])
    after = engine.generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=6))
    assert after.response_log_probs != before
    expected = teacher_forced(model, PROMPTS[0], after.response_ids[0])
    torch.testing.assert_close(torch.tensor(after.response_log_probs[0]), expected, atol=1e-4, rtol=0)
    with pytest.raises(KeyError, match="no parameter named"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(PROMPTS, SamplingSettings(max_new_tokens=200))
    engine.sleep()  # frees the cache; the next generate allocates it again
    again = engine.generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=6))
    assert again.response_ids == after.response_ids


def test_loads_a_checkpoint_and_refuses_moe(tmp_path):
    import dataclasses

    from grpo_core.rollout.static import StaticEngine

    model, shape = tiny("qwen3", tmp_path)
    loaded = StaticEngine(shape, [2], dtype="float32", max_model_len=64).load(tmp_path / "qwen3")
    pushed = engine_for(model, shape)
    settings = SamplingSettings(temperature=0, max_new_tokens=5)
    assert loaded.generate(PROMPTS, settings).response_ids == pushed.generate(PROMPTS, settings).response_ids
    moe = dataclasses.replace(shape, num_experts=4, moe_ffn_hidden_size=32, experts_per_token=2)
    with pytest.raises(NotImplementedError, match="rollout.name=vllm or hf"):
        StaticEngine(moe, [2])


def test_dry_run_refuses_the_static_engine_for_moe(capsys):
    """Before any GPU: one line and exit 2, the reason the engine itself would give."""
    from grpo_core.cli import main

    code = main(
        [
            "train",
            "--dry-run",
            "actor_rollout_ref.model.path=Qwen/Qwen3-235B-A22B",
            "actor_rollout_ref.rollout.name=static",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "rollout.name=static runs dense Llama/Qwen2/Qwen3 without RoPE scaling, not this qwen3_moe (MoE)" in err
    assert "Traceback" not in err


def fidelity(model, gen) -> float:
    """The largest gap between a generation's log-probs and the fp32 model's for the same tokens."""
    return max(
        (torch.tensor(log_probs) - teacher_forced(model, PROMPTS[gen.group_index[row]], response)).abs().max().item()
        for row, (response, log_probs) in enumerate(zip(gen.response_ids, gen.response_log_probs, strict=True))
    )


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_packed_and_compiled_cpu_decoding_keep_the_plain_engines_tokens_and_fidelity(kind, tmp_path):
    """On CPUs with oneDNN bf16 the engine multiplies by weights packed once (``pack``): the same products as
    ``F.linear``, so the same greedy tokens and log-probs; its decode layers compiled whole (``one_token_layer``:
    the attention's sums in fp32 where the eager products round scores to bf16) log-probs as close to the fp32
    model's. After ``update_weights`` the packed copies follow. qwen2: QKV biases; qwen3: q/k norms."""
    from grpo_core.rollout.static import StaticEngine, can_compile_on_cpu, can_pack

    if not (can_pack(torch.device("cpu"), torch.bfloat16) and can_compile_on_cpu()):
        pytest.skip("this CPU's oneDNN has no bf16, or torch.compile has no C++ compiler here")
    model, shape = tiny(kind, tmp_path)
    settings = SamplingSettings(n=2, temperature=0.0, max_new_tokens=8)
    engines = [
        StaticEngine(shape, [511], "bfloat16", max_model_len=128, max_batch_size=8, pack_weights=p, compile_decode=c)
        for p, c in ((False, False), (True, False), (True, True))
    ]
    assert [e._weights for e in engines] == [None] * 3
    for step in range(2):
        if step:  # the lm_head (untied here) and a layer's MLP change: every engine must follow
            with torch.no_grad():
                model.lm_head.weight.mul_(1.5)
                model.model.layers[1].mlp.down_proj.weight.mul_(-1)
        for engine in engines:
            engine.update_weights(model.state_dict().items())
        plain, packed, compiled = (engine.generate(PROMPTS, settings) for engine in engines)
        assert packed.response_ids == plain.response_ids
        want = torch.tensor(plain.response_log_probs)
        torch.testing.assert_close(torch.tensor(packed.response_log_probs), want, atol=1e-6, rtol=0)
        # against the model's own fp32 log-probs of each engine's tokens (bf16 rounding may flip a near-tie, so
        # greedy tokens can part): the compiled layers about as far off as bf16's eager products (0.14 and 0.15 on
        # qwen2 here, with its large random weights; a wrong slice or rotation is off by more than 1)
        errors = [fidelity(model, gen) for gen in (plain, compiled)]
        assert errors[1] <= 1.5 * errors[0], errors
        if step == 0:
            first = packed.response_log_probs
    assert packed.response_log_probs != first  # the update reached the packed weights
    with pytest.raises(ValueError, match="pack_weights"):
        StaticEngine(shape, [511], "float32", max_model_len=128, pack_weights=True)
    with pytest.raises(ValueError, match="compile_decode needs pack_weights"):
        StaticEngine(shape, [511], "bfloat16", max_model_len=128, pack_weights=False, compile_decode=True)


@pytest.mark.parametrize("attend", ["grouped_matmul_attention", "summed_attention"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_the_cpu_decode_attention_is_sdpa_s(attend, dtype, tol):
    """The CPU's decode attentions (eager: two batched products per KV group; compiled: products and sums; softmax
    in fp32) against torch's SDPA with grouped heads: rows of one query over caches with masked slots (a prompt's
    padding, unwritten slots), the keys and values strided views of one cache as the engine passes them."""
    import torch.nn.functional as F

    from grpo_core.rollout import decode_attention

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, length, d = 5, 6, 2, 37, 16
    q = torch.randn(b, heads, 1, d, generator=g).to(dtype)
    cache = torch.randn(b, 2 * kv_heads, length + 11, d, generator=g).to(dtype)
    keys, values = cache[:, :, :length].split(kv_heads, 1)
    bias = torch.zeros(b, 1, 1, length, dtype=dtype)
    for row in range(b):
        bias[row, ..., :row] = float("-inf")  # padding before the prompt
        bias[row, ..., length - row :] = float("-inf")  # slots not written yet
    want = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=bias.float(),
                                          enable_gqa=True)  # fmt: skip
    got = getattr(decode_attention, attend)(q, keys, values, bias)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


def test_a_cpu_decode_step_that_cannot_compile_decodes_eagerly_and_says_so(tmp_path):
    """A broken C++ toolchain (here a compiler that is /bin/false, with an empty inductor cache so it is asked): the
    engine says so in one line and decodes eagerly, the same greedy tokens as an engine that never compiled."""
    import subprocess
    import sys

    from grpo_core.rollout.static import can_pack

    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("the compiled decode step needs oneDNN bf16")
    script = f"""
import json, torch
from pathlib import Path
from torch._inductor import config
config.cpp.cxx = (None, "/bin/false")
from tests.test_rollout_static import tiny, PROMPTS
from grpo_core.rollout.base import SamplingSettings
from grpo_core.rollout.static import StaticEngine
model, shape = tiny("llama", Path({str(tmp_path)!r}))
greedy = SamplingSettings(n=1, temperature=0.0, max_new_tokens=6)
out = []
for compiled in (True, False):
    engine = StaticEngine(shape, [511], "bfloat16", max_model_len=64, max_batch_size=4, compile_decode=compiled)
    engine.update_weights(model.state_dict().items())
    out.append(engine.generate(PROMPTS, greedy).response_ids + [engine.compile_decode])
print(json.dumps(out))
"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    fallen_back, eager = json.loads(done.stdout.strip().splitlines()[-1])
    assert fallen_back == eager and fallen_back[-1] is False
    assert "static engine: compiling the CPU decode step failed, decoding eagerly (InvalidCxxCompiler" in done.stderr
    assert "Traceback" not in done.stderr
