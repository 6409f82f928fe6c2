"""A checkpoint's records: its trainer state (``trainer_state.json``) and its manifest (``manifest.json``).

The trainer state decides what a resume or an export builds: the model's Hugging Face config (an export allocates
what it says), the LoRA settings, the data position and the rows drawn. Its sizes are bounded far above any model
there is, so a changed number is refused in one line instead of allocating terabytes.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

from grpo_core.config.schema import CHECKPOINT_CONTENTS, DTYPES
from grpo_core.records.reader import Count, Digest, Hex32, Hex64, Name, Record, RelativePath, RowId


def _size(most: int, least: int = 1):
    return Annotated[int, Field(ge=least, le=most)]


def _scalar(value: Any) -> Any:
    if value is not None and not isinstance(value, bool | int | float | str):
        raise ValueError("expected a number, a string, true or false, or null")
    return value


Scalar = Annotated[Any, AfterValidator(_scalar)]


class HFConfig(Record):
    """What models/shape.py's ModelShape reads of a Hugging Face config, typed and bounded where present (ModelShape
    says which it needs); the rest is kept as it is."""

    model_type: Annotated[str, Field(max_length=64)] | None = None
    hidden_size: _size(1 << 16) | None = None
    num_hidden_layers: _size(1 << 10) | None = None
    num_attention_heads: _size(1 << 10) | None = None
    num_key_value_heads: _size(1 << 10) | None = None
    head_dim: _size(1 << 12) | None = None
    intermediate_size: _size(1 << 20) | None = None
    vocab_size: _size(1 << 22) | None = None
    max_position_embeddings: _size(1 << 24) | None = None
    tie_word_embeddings: bool | None = None
    attention_bias: bool | None = None
    num_experts: _size(1 << 12, 0) | None = None
    num_local_experts: _size(1 << 12, 0) | None = None
    moe_intermediate_size: _size(1 << 20, 0) | None = None
    num_experts_per_tok: _size(1 << 12, 0) | None = None
    rope_theta: Annotated[float, Field(gt=0)] | None = None
    rms_norm_eps: Annotated[float, Field(gt=0, lt=1)] | None = None


class LoRARecord(Record, extra="forbid"):
    """models/lora_settings.py's ``LoRASettings.record()`` and the base the adapters belong to; nothing else
    (``LoRASettings.from_record`` takes every field)."""

    base_model: Name
    rank: _size(1 << 16)
    alpha: Annotated[float, Field(gt=0)]
    dropout: Annotated[float, Field(ge=0, lt=1)]
    target_modules: list[Name]
    exclude_modules: list[Name]
    a_init: Name
    b_init: Name
    seed: int


class DataPosition(Record):
    """What the data position counts in (data/prompts.py position_data) and the training set's rows."""

    train_digest: Digest
    seen_sha256: Hex64
    rows: Count | None = None


class OptimizerLayout(Record):
    tp: _size(1 << 12)
    pp: _size(1 << 12)


class TrainerState(Record):
    """``trainer_state.json``: what checkpoint/manager.py and trainer/setup.py write beside the weights."""

    what = "trainer state"
    max_bytes = 256 << 20  # the rows drawn: 20 bytes each, millions of rows

    step: Count | None = None  # every save writes it: verify_checkpoint requires it
    data_position: Count | None = None
    world_size: _size(1 << 20) | None = None
    contents: list[Literal[CHECKPOINT_CONTENTS]] | None = None
    hf_config: HFConfig | None = None
    dtype: Literal[DTYPES] | None = None
    tokenizer_path: Name | None = None
    data: DataPosition | None = None
    rows_seen: list[RowId] | None = None
    lora: LoRARecord | None = None
    lr_scheduler: dict[str, Scalar] | None = None
    optimizer_format: Literal["fully_reshardable", "dp_reshardable"] | None = None
    optimizer_layout: OptimizerLayout | None = None


class ManifestEntry(Record):
    size: Annotated[int, Field(ge=0, le=1 << 50)]
    hash: Hex32  # xxh3-128


class CheckpointManifest(Record):
    """``manifest.json``: every file of a checkpoint (a path inside it), its size and hash (checkpoint/manifest.py)."""

    what = "checkpoint manifest"
    max_bytes = 64 << 20

    hash: Name
    files: dict[RelativePath, ManifestEntry]
