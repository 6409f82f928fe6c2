"""SmolLM2-135M's shape with 12 query / 4 KV heads (its 9/3 do not split over TP=2; same parameter count),
randomly initialised in bf16, with its tokenizer files: a model for GPU runs that measure work, not answers.
    python3 bench/random_tp2_model.py SMOLLM2_DIR OUT_DIR"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
config = AutoConfig.from_pretrained(src)
config.num_attention_heads, config.num_key_value_heads = 12, 4
config.head_dim = config.hidden_size // 12
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(dst)
for f in src.iterdir():
    if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
        shutil.copy2(f, dst / f.name)
