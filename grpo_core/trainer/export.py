"""``grpo export CHECKPOINT OUT_DIR``: a training checkpoint (any layout) as a Hugging Face model."""

from pathlib import Path


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Load the actor's weights at TP=1 in this process and write safetensors + config (+ tokenizer)."""
    from grpo_core import actor  # noqa: F401  (CPU compatibility before megatron)
    from grpo_core.actor.actor import ActorSettings, MegatronActor
    from grpo_core.actor.parallel import init_model_parallel
    from grpo_core.models.bridge import write_hf_model
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
