"""``grpo export CHECKPOINT OUT_DIR [--peft]``: a training checkpoint (any layout) as a Hugging Face model, or a LoRA
checkpoint's adapters as a PEFT adapter directory. A LoRA checkpoint holds only the adapters: the base comes from
the model its trainer state names, and the Hugging Face export is the merged W + alpha/rank B A."""

from dataclasses import replace
from pathlib import Path


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, peft: bool = False) -> Path:
    """Load the actor's weights at TP=1 in this process and write safetensors + config (+ tokenizer); with ``peft``,
    the adapters of a LoRA checkpoint in peft's format."""
    from grpo_core import actor  # noqa: F401  (CPU compatibility before megatron)
    from grpo_core.actor.actor import ActorSettings, MegatronActor
    from grpo_core.actor.parallel import init_model_parallel
    from grpo_core.checkpoint.manager import CheckpointError, load_actor_state, read_trainer_state, verify_checkpoint
    from grpo_core.models.bridge import write_hf_model, write_peft_adapter, write_rows_seen
    from grpo_core.models.lora_settings import LoRASettings
    from grpo_core.models.shape import ModelShape, model_weights_dir
    from grpo_core.planning.layout import ParallelLayout

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    verify_checkpoint(checkpoint)  # a damaged file is named here, not by a traceback from torch's reader
    state = read_trainer_state(checkpoint)
    if "hf_config" not in state:
        raise CheckpointError(f"{checkpoint}: the trainer state has no hf_config; it was not written by `grpo train`")
    shape = ModelShape.from_hf_config(state["hf_config"])
    layout = ParallelLayout(world_size=1)
    init_model_parallel(layout, seed=0)
    lora = state.get("lora")
    if peft and lora is None:
        raise CheckpointError(
            f"{checkpoint}: --peft: the checkpoint holds no LoRA adapters (it trained all parameters)"
        )
    settings = ActorSettings(layout=layout, dtype=state.get("dtype", "float32"))
    base = None
    if lora is not None:  # the base model's weights, then the checkpoint's adapters on them
        settings = replace(
            settings, lora=LoRASettings.from_record({k: v for k, v in lora.items() if k != "base_model"})
        )
        base = str(model_weights_dir(lora["base_model"]))
    policy = MegatronActor(shape, settings, hf_path=base, trainable=False)
    load_actor_state(checkpoint, policy)
    if peft:
        write_peft_adapter(policy.model, shape, out_dir, settings.lora, lora["base_model"])
        write_rows_seen(out_dir, state)  # a run from the adapter draws the rows it has not seen first
    else:
        write_hf_model(policy.model, shape, out_dir, state)
    return out_dir
