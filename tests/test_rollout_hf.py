"""HFEngine against plain transformers on a tiny random Llama, and the padded batch layout by hand."""

import pytest
import torch

from grpo_core.rollout import Generation, SamplingSettings, draw, to_rollout_batch
from tests.support.tiny import TOKENIZER, tiny_llama


@pytest.fixture(scope="module")
def tokenizer():
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    from grpo_core.rollout.hf import load_tokenizer

    return load_tokenizer(str(TOKENIZER))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = ["What is 2 + 2?", "Name a colour.", "Natalia sold clips to 48 of her friends in April, how many?"]
    return [tokenizer.encode(t) for t in texts]  # different lengths, so left padding matters


def teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The model's log-probs of ``response`` after ``prompt``: one unpadded forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_sampled_shapes_grouping_and_log_probs(tokenizer, prompts):
    from grpo_core.rollout.hf import HFEngine

    model = tiny_llama()
    engine = HFEngine(model, tokenizer, max_batch_size=8)  # 3 prompts x 4 samples: two chunks
    settings = SamplingSettings(n=4, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=6, seed=1)
    gen = engine.generate(prompts, settings)
    assert gen.prompt_ids == prompts
    assert gen.group_index == [0] * 4 + [1] * 4 + [2] * 4
    assert len(gen.response_ids) == len(gen.response_log_probs) == len(gen.finish_reasons) == 12
    assert all(
        len(r) == 6 and reason == "length" for r, reason in zip(gen.response_ids, gen.finish_reasons, strict=True)
    )
    assert len({tuple(r) for r in gen.response_ids}) > 1  # sampling, not greedy
    # Temperature-1 log-probs of the model itself, whatever the sampling settings were.
    for row, response in enumerate(gen.response_ids):
        expected = teacher_forced(model, prompts[gen.group_index[row]], response)
        torch.testing.assert_close(torch.tensor(gen.response_log_probs[row]), expected, atol=1e-4, rtol=0)
    # The same seed gives the same samples.
    assert engine.generate(prompts, settings).response_ids == gen.response_ids


def test_greedy_is_deterministic_and_matches_plain_generate(tokenizer, prompts):
    from grpo_core.rollout.hf import HFEngine

    model = tiny_llama()
    engine = HFEngine(model, tokenizer)
    gen = engine.generate(prompts, SamplingSettings(n=2, temperature=0.0, max_new_tokens=8))
    assert (
        gen.response_ids == engine.generate(prompts, SamplingSettings(greedy=True, n=2, max_new_tokens=8)).response_ids
    )
    for i, prompt in enumerate(prompts):
        plain = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8)
        assert gen.response_ids[2 * i] == gen.response_ids[2 * i + 1] == plain[0, len(prompt) :].tolist()


def test_draw_adds_a_greedy_baseline_per_prompt_that_is_not_a_sample(tokenizer, prompts):
    """remax's baseline: one greedy answer per prompt beside the n samples, kept through a regrouping and a concat."""
    from grpo_core.rollout.hf import HFEngine

    model = tiny_llama()
    engine = HFEngine(model, tokenizer)
    settings = SamplingSettings(n=3, temperature=1.0, max_new_tokens=5, seed=2, greedy_baseline=True)
    gen = draw(engine, prompts, settings)
    plain = engine.generate(prompts, SamplingSettings(n=3, temperature=1.0, max_new_tokens=5, seed=2))
    assert gen.response_ids == plain.response_ids and gen.group_index == plain.group_index  # the samples as without
    greedy = engine.generate(prompts, SamplingSettings(n=1, temperature=0.0, max_new_tokens=5)).response_ids
    assert gen.baseline_ids == greedy and plain.baseline_ids is None
    assert gen.groups([2, 0]).baseline_ids == [greedy[2], greedy[0]]
    assert Generation.concat([gen.groups([1]), gen.groups([0])]).baseline_ids == [greedy[1], greedy[0]]
    assert Generation.concat([gen, plain]).baseline_ids is None  # a part without baselines: none for the whole


def test_stop_token_trims_and_sets_finish_reason(tokenizer, prompts):
    from grpo_core.rollout.hf import HFEngine

    model = tiny_llama()
    greedy = SamplingSettings(greedy=True, max_new_tokens=6)
    first = HFEngine(model, tokenizer).generate(prompts, greedy)
    assert first.finish_reasons == ["length"] * 3  # a random model does not say EOS within 6 tokens
    stop = first.response_ids[0][0]  # declare prompt 0's first greedy token a stop token
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]  # the engine reads the model's EOS ids too
    gen = HFEngine(model, tokenizer).generate(prompts, greedy)
    assert gen.response_ids[0] == [stop] and gen.finish_reasons[0] == "stop" and len(gen.response_log_probs[0]) == 1
    for before, after, reason in zip(first.response_ids, gen.response_ids, gen.finish_reasons, strict=True):
        ended = stop in before  # other rows keep going while one has stopped, and are cut at their own stop
        assert after == (before[: before.index(stop) + 1] if ended else before)
        assert reason == ("stop" if ended else "length")


def test_update_weights_tied_embeddings(tokenizer, prompts):
    from grpo_core.rollout.hf import HFEngine

    engine = HFEngine(tiny_llama(seed=0), tokenizer)
    prompt, response = prompts[0], [100, 200, 300]
    before = teacher_forced(engine.model, prompt, response)
    target = tiny_llama(seed=1)  # the "trained" weights
    pushed = {name: t for name, t in target.state_dict().items() if name != "lm_head.weight"}  # as a trainer sends
    engine.update_weights(pushed.items())
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(engine.model.lm_head.weight, target.lm_head.weight, atol=0, rtol=0)
    after = teacher_forced(engine.model, prompt, response)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, teacher_forced(target, prompt, response), atol=1e-5, rtol=0)
    greedy = SamplingSettings(greedy=True, max_new_tokens=5)
    ours, fresh = engine.generate(prompts, greedy), HFEngine(target, tokenizer).generate(prompts, greedy)
    assert ours.response_ids == fresh.response_ids
    for a, b in zip(ours.response_log_probs, fresh.response_log_probs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_update_weights_fails_loudly(tokenizer):
    from grpo_core.rollout.hf import HFEngine

    engine = HFEngine(tiny_llama(), tokenizer)
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(32,\), the model expects \(64,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(32))])
    engine.sleep(), engine.wake()  # no-ops on CPU
    assert engine.model.device.type == "cpu"


def test_missing_model_dir_is_one_line_error(tmp_path):
    from grpo_core.rollout.hf import HFEngine, ModelLoadError

    with pytest.raises(ModelLoadError, match="model directory .*nowhere does not exist"):
        HFEngine(str(tmp_path / "nowhere"), tokenizer=None)


def test_to_rollout_batch_layout_by_hand():
    gen = Generation(
        prompt_ids=[[11, 12, 13], [21]],
        response_ids=[[31, 2], [32, 33, 34], [41], []],
        response_log_probs=[[-0.1, -0.2], [-0.3, -0.4, -0.5], [-0.6], []],
        finish_reasons=["stop", "length", "length", "stop"],
        group_index=[0, 0, 1, 1],
    )
    batch = to_rollout_batch(gen, pad_id=0)
    assert batch.input_ids.tolist() == [
        [11, 12, 13, 31, 2, 0],
        [11, 12, 13, 32, 33, 34],
        [0, 0, 21, 41, 0, 0],
        [0, 0, 21, 0, 0, 0],
    ]
    assert batch.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 0, 0, 0],
    ]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]]  # EOS (2) counts
    assert batch.responses.tolist() == [[31, 2, 0], [32, 33, 34], [41, 0, 0], [0, 0, 0]]
    assert batch.position_ids[2].tolist() == [0, 0, 0, 1, 1, 1]
    # the engine's log-probs on the response grid, 0 past each response (for rollout importance sampling)
    expected = torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5], [-0.6, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(batch.rollout_log_probs, expected)

    fixed = to_rollout_batch(gen, pad_id=7, max_prompt_len=4, max_response_len=4)
    assert fixed.input_ids.shape == (4, 8) and fixed.response_mask.shape == (4, 4)
    assert fixed.input_ids[0].tolist() == [7, 11, 12, 13, 31, 2, 7, 7]
    with pytest.raises(ValueError, match="max_prompt_len=2"):
        to_rollout_batch(gen, pad_id=0, max_prompt_len=2)
    with pytest.raises(ValueError, match="max_response_len=2"):
        to_rollout_batch(gen, pad_id=0, max_response_len=2)


def test_sampling_settings_checks():
    assert SamplingSettings(temperature=0).is_greedy and not SamplingSettings().is_greedy
    with pytest.raises(ValueError, match="n must be >= 1.*top_k must be -1"):
        SamplingSettings(n=0, top_k=0)


def test_config_overrides_reach_the_loaded_model(tmp_path):
    """actor_rollout_ref.model.override_config.model_config, as build_engine passes it to the HF engine."""
    from grpo_core.rollout.hf import load_model

    tiny_llama().save_pretrained(tmp_path)  # max_position_embeddings 512
    assert load_model(str(tmp_path)).config.max_position_embeddings == 512
    overrides = {"max_position_embeddings": 10240, "attention_dropout": 0.5, "rope_theta": 5e5}
    model = load_model(str(tmp_path), config_overrides=overrides)
    assert model.config.max_position_embeddings == 10240
    assert model.model.layers[0].self_attn.attention_dropout == 0.5  # read when the model is built
    # transformers 5 keeps the RoPE base in rope_parameters: the override reaches the rotary frequencies.
    assert model.model.rotary_emb.inv_freq[1].item() == pytest.approx(5e5 ** (-2 / 16), rel=1e-6)  # head_dim 16
