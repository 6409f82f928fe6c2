"""LoRA on the megatron actor against transformers + peft with the same adapters, on a tiny Llama and a tiny Qwen2.

One torchrun launch (2 processes, tests/dist/lora_worker.py) runs each model at TP=1 (DP=2), TP=2 (with and without
sequence parallelism), PP=2 and CP=2; this process
rebuilds the same adapters in peft (a fused linear's adapter is one peft adapter per module it fuses: the same A,
B's rows cut apart) and checks: log-probs with and without the adapters, the gradients of A and B, that one update
changes only the adapters (megatron's DDP and optimizer hold nothing else), that every layout gives TP=1's update,
and that the rollout engines' merged weights are peft's merge_and_unload."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.dist.launch import torchrun

pytest.importorskip("peft")

TOL = 1e-5
RANK, ALPHA = 4, 8.0  # the worker's LoRASettings
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def hf_model(name: str, path=None):
    import transformers

    config_cls, model_cls = MODELS[name]
    config = getattr(transformers, config_cls)(**COMMON)
    torch.manual_seed(len(name))
    model = getattr(transformers, model_cls)(config).float()
    if path is not None:
        model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    for name in MODELS:
        hf_model(name, root / name)
    out = root / "out"
    out.mkdir()
    models = ",".join(f"{name}={root / name}" for name in MODELS)
    torchrun("lora_worker.py", 2, "--models", models, "--out", str(out))
    return root, json.loads((out / "results.json").read_text())


def tensors(root, key: str, part: str) -> dict[str, torch.Tensor]:
    return load_file(root / "out" / f"{key}_{part}.safetensors")


def peft_model(root, name: str, adapters: dict[str, torch.Tensor]):
    """The HF model from the files the actor loaded, with peft's LoRA holding ``adapters``."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / name, torch_dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
    result = set_peft_model_state_dict(model, adapters)
    assert not result.unexpected_keys
    return model


def response_log_probs(model, result: dict) -> torch.Tensor:
    """The actor's numbers, from HF: positions counted over the tokens, each response token's log-prob [B, R]."""
    ids, attn = torch.tensor(result["input_ids"]), torch.tensor(result["attention_mask"])
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    r = len(result["response_mask"][0])
    return lp[:, -r:]


def close(a, b, mask=None) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if mask is not None:
        a, b = a[mask], b[mask]
    return torch.allclose(a, b, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_log_probs_with_and_without_adapters_are_peft_s(lora_run, name):
    root, results = lora_run
    result = results[f"{name}_tp1"]
    mask = torch.tensor(result["response_mask"]).bool()
    model = peft_model(root, name, tensors(root, f"{name}_tp1", "before"))
    with torch.no_grad():
        assert close(result["log_probs"], response_log_probs(model, result), mask)
        with model.disable_adapter():  # the reference of a LoRA run: the base
            assert close(result["base_log_probs"], response_log_probs(model, result), mask)
    assert not close(result["log_probs"], result["base_log_probs"], mask)  # the adapters act


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_of_a_and_b_are_peft_s(lora_run, name):
    root, results = lora_run
    result = results[f"{name}_tp1"]
    model = peft_model(root, name, tensors(root, f"{name}_tp1", "before"))
    mask = torch.tensor(result["response_mask"])
    lp = response_log_probs(model, result)  # on-policy GRPO, token-mean: -sum(adv * grad log p) / tokens
    (-(torch.tensor(result["advantages"]) * lp * mask).sum() / mask.sum()).backward()
    peft_grads = {k.replace(".default", ""): p.grad for k, p in model.named_parameters() if "lora_" in k}
    ours = tensors(root, f"{name}_tp1", "grads")
    assert set(ours) == set(peft_grads)
    for key, grad in ours.items():
        if key.endswith("lora_B.weight"):
            assert close(grad, peft_grads[key]), key
    # one A per fused linear: its gradient is the sum of the peft A's of the modules it fuses
    for layer in range(COMMON["num_hidden_layers"]):
        for group in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            prefix = f"base_model.model.model.layers.{layer}.{group[0]}"
            keys = [f"{prefix}.{m}.lora_A.weight" for m in group[1]]
            assert close(ours[keys[0]], sum(peft_grads[k] for k in keys)), keys
        for single in ("self_attn.o_proj", "mlp.down_proj"):
            key = f"base_model.model.model.layers.{layer}.{single}.lora_A.weight"
            assert close(ours[key], peft_grads[key]), key


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2sp", "pp2", "cp2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_only_the_adapters_train_and_the_base_stays_the_reference(lora_run, name, layout):
    _, results = lora_run
    result = results[f"{name}_{layout}"]
    assert result["trainable_all_adapters"] and result["buffers_hold_only_adapters"]
    # no fp32 master or Adam state for the frozen base
    assert result["adam_numel"] * result["adam_shards"] == result["lora_numel"]
    assert result["base_unchanged"]  # bit-identical after the step
    assert result["base_after_change"] < 1e-6  # the reference (adapters off) did not move
    mask = torch.tensor(result["response_mask"]).bool()
    assert not close(result["log_probs_after"], result["log_probs"], mask)  # the adapters did


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2sp", "pp2", "cp2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_an_exported_adapter_loaded_at_any_layout_is_the_same_policy(lora_run, name, layout):
    """The adapters after the step, in peft's names (`grpo export --peft`'s), loaded into a fresh actor of the layout
    (a warm start from a registry adapter): its log-probs are those of the actor that trained them."""
    _, results = lora_run
    result = results[f"{name}_{layout}"]
    mask = torch.tensor(result["response_mask"]).bool()
    assert close(result["log_probs_loaded"], result["log_probs_after"], mask)


@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "pp2", "cp2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_layout_gives_tp1_s_update(lora_run, name, layout):
    root, results = lora_run
    one, two = results[f"{name}_tp1"], results[f"{name}_{layout}"]
    assert two["sequence_parallel"] == (layout == "tp2sp")  # the adapters took the sequence-parallel path
    mask = torch.tensor(one["response_mask"]).bool()
    for key in ("log_probs", "base_log_probs", "log_probs_after"):
        assert close(one[key], two[key], mask), key
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], abs=TOL)
    # at CP2 the distributed optimizer's reduce-scatter leaves each rank half the gradients: the update shows them
    parts = ("before", "after", "merged") if layout == "cp2" else ("before", "grads", "after", "merged")
    for part in parts:
        a, b = tensors(root, f"{name}_tp1", part), tensors(root, f"{name}_{layout}", part)
        assert set(a) == set(b), part
        for key in a:
            assert close(a[key], b[key]), (part, key)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_engines_get_peft_s_merged_weights(lora_run, name):
    root, _ = lora_run
    model = peft_model(root, name, tensors(root, f"{name}_tp2", "after"))
    expected = model.merge_and_unload().state_dict()
    merged = tensors(root, f"{name}_tp2", "merged")
    assert set(merged) == set(expected)
    for key, value in merged.items():
        assert close(value, expected[key]), key


def test_a_checkpoint_holds_the_adapters_and_their_adam_state_at_any_layout(lora_run):
    """Saved at TP2 with sequence parallelism, loaded at TP1 (DP2): the same policy, and the same next update."""
    _, results = lora_run
    numbers = results["checkpoint"]
    mask = torch.tensor(numbers["response_mask"]).bool()
    assert close(numbers["tp1_loaded"], numbers["tp2sp_saved"], mask)
    assert numbers["tp1_next_grad_norm"] == pytest.approx(numbers["tp2sp_next_grad_norm"], abs=TOL)
    assert close(numbers["tp1_next"], numbers["tp2sp_next"], mask)
