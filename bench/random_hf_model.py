"""A randomly initialised Hugging Face checkpoint of a model's shape, with a tokenizer's files beside it:
a model for GPU runs that measure work, not answers (throughput does not depend on the weights).

    python3 bench/random_hf_model.py --model Qwen/Qwen2.5-1.5B --tokenizer TOKENIZER_DIR OUT_DIR
    python3 bench/random_hf_model.py --model SMOLLM2_DIR --heads 12 4 OUT_DIR   # SmolLM2 split over TP=2

``--model``: a directory with a config.json, or a name from grpo_core's table of known configs.
``--heads Q KV``: other head counts (SmolLM2-135M's 9/3 do not split over TP=2; 12/4 keeps its size).
The tokenizer (default: ``--model`` when it is a directory) may have a smaller vocabulary than the model.
"""

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_core.models.known_configs import transformers_config

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--tokenizer", default=None)
p.add_argument("--heads", type=int, nargs=2, default=None)
p.add_argument("out")
args = p.parse_args()

local = Path(args.model).is_dir()
config = AutoConfig.from_pretrained(args.model) if local else transformers_config(args.model)
if args.heads:
    config.num_attention_heads, config.num_key_value_heads = args.heads
    config.head_dim = config.hidden_size // args.heads[0]
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(args.out)
tokenizer = Path(args.tokenizer or args.model)
for f in tokenizer.iterdir():
    if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
        shutil.copy2(f, Path(args.out) / f.name)
