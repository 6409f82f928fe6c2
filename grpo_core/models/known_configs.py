"""``config.json`` fields of the models verl's GRPO guide uses, so dry runs and plans work offline.

Only the fields ``ModelShape`` reads are kept; values are those of the published Hugging Face configs.
Instruct variants share their base model's shape and are found by the same entry.
"""

_QWEN2_VOCAB = {
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
_QWEN25_SMALL = {
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}

_LLAMA31_VOCAB = {
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
}

_QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,  # the dense MLP size; unused, every layer is MoE (mlp_only_layers empty)
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}

KNOWN_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen2-7B": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        **_QWEN2_VOCAB,
    },
    "Qwen/Qwen2.5-0.5B": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        **_QWEN25_SMALL,
    },
    "Qwen/Qwen2.5-1.5B": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        **_QWEN25_SMALL,
    },
    "Qwen/Qwen2.5-3B": {
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        **_QWEN25_SMALL,
    },
    "Qwen/Qwen2.5-32B": {
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        **_QWEN2_VOCAB,
    },
    "Qwen/Qwen3-235B-A22B": {
        "model_type": "qwen3_moe",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
    "Qwen/Qwen3-30B-A3B": {**_QWEN3_30B_A3B, "max_position_embeddings": 40960, "rope_theta": 1000000.0},
    "Qwen/Qwen3-30B-A3B-Base": {**_QWEN3_30B_A3B, "max_position_embeddings": 32768, "rope_theta": 1000000.0},
    "Qwen/Qwen3-30B-A3B-Instruct-2507": {
        **_QWEN3_30B_A3B,
        "max_position_embeddings": 262144,
        "rope_theta": 10000000.0,
    },
    "deepseek-ai/deepseek-llm-7b-chat": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 30,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "vocab_size": 102400,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
    },
    "meta-llama/Llama-3.1-8B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        **_LLAMA31_VOCAB,
    },
    "meta-llama/Llama-3.1-70B": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        **_LLAMA31_VOCAB,
    },
    "HuggingFaceTB/SmolLM2-135M": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
    },
}


KNOWN_CONFIGS["Qwen/Qwen2.5-7B"] = KNOWN_CONFIGS["Qwen/Qwen2-7B"]  # same shape
KNOWN_CONFIGS["deepseek-ai/deepseek-llm-7b-base"] = KNOWN_CONFIGS["deepseek-ai/deepseek-llm-7b-chat"]


def transformers_config(name: str):
    """A table entry as a transformers ``PretrainedConfig``: enough to build the model with random weights
    (benchmarks), without the hub. KeyError for a name the table does not have."""
    from transformers import AutoConfig

    known = find_known_config(name)
    if known is None:
        raise KeyError(f"{name} is not in grpo_core's table of known configs")
    known = dict(known)
    return AutoConfig.for_model(known.pop("model_type"), **known)


def find_known_config(name: str) -> dict | None:
    """Look a hub id up by its last path part, case-insensitively, with '-Instruct' ignored."""
    wanted = name.rstrip("/").split("/")[-1].lower().removesuffix("-instruct")
    for repo_id, config in KNOWN_CONFIGS.items():
        if repo_id.split("/")[-1].lower() == wanted:
            return config
    return None
