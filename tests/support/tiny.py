"""Small real inputs for end-to-end tests: a randomly initialised Llama that shares the SmolLM2 tokenizer,
and a prompt file for the synthetic "capitals" task (learnable from scratch)."""

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TOKENIZER = Path(__file__).resolve().parents[3] / "shared" / "models" / "smollm2-135m-instruct" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tiny_llama(seed: int = 0, hidden: int = 64, layers: int = 2, tied: bool = True, init_range: float = 0.02):
    """A random Llama with the SmolLM2 vocabulary (49152), 4 heads / 2 KV heads.

    ``init_range`` above the usual 0.02 gives a peaked (low-entropy) random policy, which GRPO can
    sharpen in a few steps; at 0.02 the policy is uniform over 49k tokens and learns far slower."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=init_range,
    )
    return LlamaForCausalLM(config).eval()


def tiny_model_dir(out: Path, **kwargs) -> Path:
    """``tiny_llama(**kwargs)`` saved with the SmolLM2 tokenizer files: a loadable model directory."""
    tiny_llama(**kwargs).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (TOKENIZER / name).is_file():
            shutil.copy2(TOKENIZER / name, out / name)
    return out


WORDS = ("apple", "river", "stone", "cloud", "green", "music", "paper", "light", "tiger", "bread", "ocean", "smile")


def capitals_data(out_dir: Path, rows: int = 64) -> Path:
    """train.parquet and test.parquet in verl's schema, data_source "synthetic/capitals"."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", rows), ("test", rows // 4)):
        records = [
            {
                "data_source": "synthetic/capitals",
                "prompt": [{"role": "user", "content": f"Say {WORDS[i % len(WORDS)]} {i} in capital letters."}],
                "ability": "format",
                "reward_model": {"style": "rule", "ground_truth": ""},
                "extra_info": {"split": split, "index": i},
            }
            for i in range(n)
        ]
        pq.write_table(pa.Table.from_pylist(records), out_dir / f"{split}.parquet")
    return out_dir


def cpu_train_args(tmp_path: Path) -> list[str]:
    """`grpo train` overrides for a CPU run on capitals data, SmolLM2's shape known offline: for what happens
    before the model is loaded."""
    data = capitals_data(tmp_path / "data") / "train.parquet"
    return [
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.model.path=HuggingFaceTB/SmolLM2-135M",
    ]
