"""Tests for grpo_core.models: parameter counts and how a model's config is found."""

import json
from pathlib import Path

import pytest

from grpo_core.models import ModelShape, ModelShapeError, load_model_shape
from grpo_core.models import shape as shape_module
from grpo_core.models.known_configs import KNOWN_CONFIGS

SHARED = Path(__file__).resolve().parents[2] / "shared"
SMOLLM_DIR = SHARED / "models" / "smollm2-135m-instruct" / "tokenizer"


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    """Nothing here may reach the Hugging Face hub."""

    def refuse(repo_id):
        raise AssertionError(f"tried to read {repo_id!r} from the hub")

    monkeypatch.setattr(shape_module, "_read_hub", refuse)


# ---------------------------------------------------------------- published counts


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("Qwen/Qwen2.5-0.5B", 494e6),
        ("Qwen/Qwen2.5-1.5B", 1.54e9),
        ("Qwen/Qwen2.5-7B", 7.62e9),
        ("meta-llama/Llama-3.1-8B", 8.03e9),
        ("meta-llama/Llama-3.1-70B", 70.55e9),
        ("Qwen/Qwen3-235B-A22B", 235e9),
    ],
)
def test_param_count_matches_published(name, published):
    assert load_model_shape(name).num_params == pytest.approx(published, rel=0.01)


def test_moe_active_params():
    shape = load_model_shape("Qwen/Qwen3-235B-A22B")
    assert shape.is_moe
    assert shape.active_params == pytest.approx(22e9, rel=0.01)
    # Dense models: every parameter is active.
    dense = load_model_shape("Qwen/Qwen2.5-7B")
    assert not dense.is_moe
    assert dense.active_params == dense.num_params


def test_smollm2_table_entry_is_exact():
    # 134,515,008 is the Hugging Face count of SmolLM2-135M(-Instruct).
    assert load_model_shape("HuggingFaceTB/SmolLM2-135M").num_params == 134_515_008


@pytest.mark.skipif(not SHARED.is_dir(), reason="no /work/shared checkout")
def test_smollm2_local_config_is_exact():
    shape = load_model_shape(str(SMOLLM_DIR))
    assert shape.model_type == "llama"
    assert shape.tie_embeddings
    assert shape.head_dim == 64
    assert shape.num_params == 134_515_008


# ---------------------------------------------------------------- hand-counted tiny configs

TINY = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "vocab_size": 10,
    "tie_word_embeddings": False,
}
# head_dim = 8 / 2 = 4; q width = 2*4 = 8; k + v width = 2 * 1*4 = 8
# attention per layer: q,k,v 8*(8+8) = 128, o 8*8 = 64, two RMSNorms 2*8 = 16  -> 208
# MLP per layer: gate, up, down 3*8*16 = 384                                  -> 592 per layer
# 2 layers = 1184; embedding + untied lm_head 2*10*8 = 160; final norm 8     -> 1352


def test_tiny_llama_untied():
    shape = ModelShape.from_hf_config(TINY)
    assert shape.head_dim == 4
    assert shape.attention_params_per_layer == 208
    assert shape.dense_mlp_params_per_layer == 384
    assert shape.embedding_params == 160
    assert shape.num_params == 1352


def test_tiny_llama_tied():
    # The lm_head shares the embedding: 1184 + 10*8 + 8 = 1272
    assert ModelShape.from_hf_config({**TINY, "tie_word_embeddings": True}).num_params == 1272


def test_tiny_qwen2_adds_qkv_bias():
    # q bias 8 + k bias 4 + v bias 4 = 16 per layer, 2 layers: 1352 + 32 = 1384
    shape = ModelShape.from_hf_config({**TINY, "model_type": "qwen2"})
    assert shape.qkv_bias
    assert shape.num_params == 1384


def test_tiny_llama_attention_bias_flag():
    # Llama with attention_bias=true carries the same q/k/v biases: 1384
    assert ModelShape.from_hf_config({**TINY, "attention_bias": True}).num_params == 1384


def test_tiny_qwen3_adds_qk_norm():
    # q_norm + k_norm of head_dim 4 each = 8 per layer, 2 layers: 1352 + 16 = 1368 (no QKV bias)
    shape = ModelShape.from_hf_config({**TINY, "model_type": "qwen3", "head_dim": 4})
    assert shape.qk_norm and not shape.qkv_bias
    assert shape.num_params == 1368


def test_tiny_moe():
    # 4 experts of width 6, top-2; the dense MLP is replaced by the experts plus a router.
    config = {
        **TINY,
        "model_type": "qwen3_moe",
        "head_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 6,
    }
    shape = ModelShape.from_hf_config(config)
    # attention per layer 208 + qk norm 8 = 216; router 4*8 = 32; dense per layer 248
    # dense = 2*248 + 160 + 8 = 664
    # experts per layer 4 * 3*8*6 = 576; 2 layers = 1152
    assert shape.dense_params == 664
    assert shape.expert_params == 1152
    assert shape.num_params == 664 + 1152
    # active: dense + 2 layers * 2 experts * 144 = 664 + 576 = 1240
    assert shape.active_params == 1240


def test_kv_heads_default_to_attention_heads():
    config = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    shape = ModelShape.from_hf_config(config)
    assert shape.num_kv_heads == 2
    # k + v width now 2*2*4 = 16: q,k,v 8*(8+16) = 192 (+64 more than before), per layer 656
    # 2*656 + 160 + 8 = 1480
    assert shape.num_params == 1480


def test_missing_field_raises():
    config = {k: v for k, v in TINY.items() if k != "vocab_size"}
    with pytest.raises(ModelShapeError, match="vocab_size"):
        ModelShape.from_hf_config(config)


# ---------------------------------------------------------------- lookup


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("Qwen/Qwen2-7B-Instruct", "Qwen/Qwen2-7B"),
        ("qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B"),
        ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M"),
    ],
)
def test_names_resolve_to_the_table(name, entry, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no stray local directory of the same name
    assert load_model_shape(name) == ModelShape.from_hf_config(KNOWN_CONFIGS[entry])


def test_qwen2_and_qwen25_7b_differ_only_by_name():
    assert load_model_shape("Qwen/Qwen2-7B").num_params == load_model_shape("Qwen/Qwen2.5-7B").num_params


def test_local_directory_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "vocab_size": 20}))
    # vocab 20: embeddings 2*20*8 = 320, 1184 + 320 + 8 = 1512
    assert load_model_shape(str(tmp_path)).num_params == 1512
    # The config.json file itself works too.
    assert load_model_shape(str(tmp_path / "config.json")).num_params == 1512


def test_local_directory_wins_over_the_table(tmp_path, monkeypatch):
    # A directory named like a table entry is read from disk, not from the table.
    local = tmp_path / "Qwen2.5-7B"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(TINY))
    monkeypatch.chdir(tmp_path)
    assert load_model_shape("Qwen2.5-7B").num_params == 1352


def test_malformed_config_names_file_and_line(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text('{\n  "model_type": "llama",\n  "hidden_size": 8,,\n}\n')  # error on line 3
    with pytest.raises(ModelShapeError) as excinfo:
        load_model_shape(str(tmp_path))
    message = str(excinfo.value)
    assert f"{config_file}:3" in message
    assert "malformed JSON" in message


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelShapeError, match="no config.json"):
        load_model_shape(str(tmp_path))


def test_unsupported_model_type_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "gpt2"}))
    with pytest.raises(ModelShapeError, match="'gpt2' is not supported") as excinfo:
        load_model_shape(str(tmp_path))
    for supported in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral"):
        assert repr(supported) in str(excinfo.value)


@pytest.mark.parametrize("name", ["./nope", "/definitely/not/a/model", "~/no-such-model-dir", "a/b/c", "models/nope"])
def test_missing_path_fails_without_the_hub(name, tmp_path, monkeypatch):
    """Path syntax, or an existing parent (``models/`` here): a missing directory, whatever the hub holds."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ModelShapeError, match="no such local directory"):
        load_model_shape(name)  # the autouse fixture fails the test if the hub is asked


def test_unknown_hub_id_goes_to_the_hub(monkeypatch):
    asked = []

    def fake_hub(repo_id):
        asked.append(repo_id)
        return TINY

    monkeypatch.setattr(shape_module, "_read_hub", fake_hub)
    assert load_model_shape("some-org/some-model").num_params == 1352
    assert asked == ["some-org/some-model"]


# ---------------------------------------------------------------- added table entries


def test_deepseek_llm_7b_chat_count_by_hand():
    # Llama layout, untied, MHA (32 KV heads): per layer attention 4096*(4096+2*4096) + 4096*4096 + 2 norms
    # = 67,117,056; MLP 3*4096*11008 = 135,266,304; x 30 layers = 6,071,500,800; embeddings + head
    # 2*102400*4096 = 838,860,800; final norm 4096.
    shape = load_model_shape("deepseek-ai/deepseek-llm-7b-chat")
    assert shape.model_type == "llama" and not shape.tie_embeddings
    assert shape.num_params == 6_071_500_800 + 838_860_800 + 4096 == 6_910_365_696
    assert shape.max_position_embeddings == 4096
    assert load_model_shape("deepseek-ai/deepseek-llm-7b-base") == shape


@pytest.mark.parametrize(
    ("name", "max_positions", "rope_theta"),
    [
        ("Qwen/Qwen3-30B-A3B-Base", 32768, 1e6),
        ("Qwen/Qwen3-30B-A3B-Instruct-2507", 262144, 1e7),
        ("Qwen/Qwen3-30B-A3B", 40960, 1e6),
    ],
)
def test_qwen3_30b_a3b_counts_by_hand(name, max_positions, rope_theta):
    # Per layer: attention 2048*(4096+2*512) + 4096*2048 + QK norms 2*128 + 2 norms 2*2048 = 18,878,720;
    # router 128*2048 = 262,144; experts 128*3*2048*768 = 603,979,776. x 48 = 29,909,790,720; untied
    # embeddings 2*151936*2048 = 622,329,856; final norm 2048. Published: 30.5B total, 3.3B active.
    shape = load_model_shape(name)
    assert shape.model_type == "qwen3_moe" and shape.qk_norm and shape.is_moe
    assert shape.num_params == 29_909_790_720 + 622_329_856 + 2048 == 30_532_122_624
    # Active: 48*(18,878,720 + 262,144) + 622,331,904 dense, plus 48*8 experts of 3*2048*768 = 4,718,592.
    assert shape.active_params == 918_761_472 + 622_331_904 + 48 * 8 * 4_718_592 == 3_353_032_704
    assert (shape.max_position_embeddings, shape.rope_theta) == (max_positions, rope_theta)


# ---------------------------------------------------------------- override_config


def test_override_config_changes_the_shape_read():
    over = {"model_config": {"max_position_embeddings": 10240}}
    assert load_model_shape("deepseek-ai/deepseek-llm-7b-chat", over).max_position_embeddings == 10240
    assert load_model_shape("deepseek-ai/deepseek-llm-7b-chat", {}).max_position_embeddings == 4096
    # Only model_config holds Hugging Face fields; the table itself is not modified.
    assert shape_module.hf_overrides({"moe_config": {"freeze_moe_router": True}}) == {}
    assert KNOWN_CONFIGS["deepseek-ai/deepseek-llm-7b-chat"]["max_position_embeddings"] == 4096


def test_unknown_override_fields():
    config = KNOWN_CONFIGS["deepseek-ai/deepseek-llm-7b-chat"]
    over = {"max_position_embeddings": 1, "attention_dropout": 0.1, "max_position_embedings": 2}
    # in config.json / a LlamaConfig attribute / a typo
    assert shape_module.unknown_override_fields(config, over) == ["max_position_embedings"]


def test_rope_theta_override_reaches_rope_parameters():
    # transformers 5 configs keep the base in rope_parameters; shape and engines must agree on the override.
    config = {
        **KNOWN_CONFIGS["deepseek-ai/deepseek-llm-7b-chat"],
        "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
    }
    merged = shape_module.with_overrides(config, {"rope_theta": 5e5})
    assert merged["rope_parameters"] == {"rope_theta": 5e5, "rope_type": "default"} and merged["rope_theta"] == 5e5
    assert ModelShape.from_hf_config(merged).rope_theta == 5e5
    assert config["rope_parameters"]["rope_theta"] == 1e4  # not modified in place
