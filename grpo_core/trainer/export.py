"""``grpo export CHECKPOINT OUT_DIR``: a training checkpoint (any layout) as a Hugging Face model."""

import json
import shutil
from pathlib import Path

import torch.distributed as dist

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Load the actor's weights at TP=1 in this process and write safetensors + config (+ tokenizer)."""
    from grpo_core import actor  # noqa: F401  (CPU compatibility before megatron)
    from grpo_core.actor.actor import ActorSettings, MegatronActor
    from grpo_core.actor.parallel import init_model_parallel
    from grpo_core.models.shape import ModelShape
    from grpo_core.planning.layout import ParallelLayout
    from grpo_core.trainer.checkpoint import CheckpointError, load_actor_state, read_trainer_state, verify_checkpoint

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    verify_checkpoint(checkpoint)  # a damaged file is named here, not by a traceback from torch's reader
    state = read_trainer_state(checkpoint)
    if "hf_config" not in state:
        raise CheckpointError(f"{checkpoint}: the trainer state has no hf_config; it was not written by `grpo train`")
    shape = ModelShape.from_hf_config(state["hf_config"])
    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=0)
    policy = MegatronActor(shape, ActorSettings(layout=layout, dtype=state.get("dtype", "float32")), trainable=False)
    load_actor_state(checkpoint, policy)
    write_hf_model(policy.model, shape, out_dir, state)
    return out_dir


def write_hf_model(model, shape, out_dir: Path, trainer_state: dict) -> None:
    """The model as Hugging Face files: weights and ``hf_config`` (every rank of the model calls this), then the
    tokenizer's files from ``tokenizer_path`` and the rows its training drew (rank 0; data/prompts.py)."""
    from grpo_core.data.prompts import SEEN_FILE
    from grpo_core.models.bridge import export_hf_weights

    export_hf_weights(model, shape, out_dir, trainer_state["hf_config"])
    if dist.get_rank() != 0:
        return
    tokenizer = Path(trainer_state.get("tokenizer_path") or "")
    if tokenizer.is_dir():
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, out_dir / name)
    if "rows_seen" in trainer_state:  # which data trained it: the training set and every row drawn, lineage included
        data = trainer_state.get("data", {})
        record = {"train_sha256": data.get("train_sha256"), "rows": data.get("rows")}
        (out_dir / SEEN_FILE).write_text(json.dumps({**record, "rows_seen": trainer_state["rows_seen"]}) + "\n")
