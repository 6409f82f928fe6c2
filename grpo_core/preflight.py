"""Checks of the input files that can be made before any process (or process group) starts, so that a bad
file costs one ``error:`` line naming it instead of a traceback from every rank minutes later.

Each check raises the error class its caller already turns into that line: ModelShapeError for the model
directory, ModelLoadError for the tokenizer, DataError for a data file.
"""

import json
import struct
from pathlib import Path

from grpo_core.data.prompts import check_data_file
from grpo_core.models.shape import ModelShapeError


def check_weights(model_dir: str | Path, formats: tuple[str, ...] = ("*.safetensors",)) -> None:
    """A local model directory has weights in one of ``formats``, and its ``*.safetensors`` headers parse (a cut
    download fails here). Training reads safetensors only; evaluation (transformers) also PyTorch's .bin."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        return  # a hub id: downloaded (and checked) by the ranks
    if not any(any(model_dir.glob(pattern)) for pattern in formats):
        raise ModelShapeError(f"{model_dir}: no {' or '.join(formats)} weights there (a model directory needs them)")
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > path.stat().st_size - 8:
                    raise ValueError(f"header of {length} bytes in a file of {path.stat().st_size}")
                json.loads(f.read(length))
        except (struct.error, ValueError) as e:
            raise ModelShapeError(f"{path}: not a safetensors file ({str(e)[:200] or 'too short'})") from None


def check_tokenizer_fits(tokenizer, vocab_size: int, tokenizer_path: str, model_path: str) -> None:
    """Token ids at or past the model's vocabulary have no embedding row: refuse such a tokenizer up front."""
    from grpo_core.rollout.hf import ModelLoadError

    if (n := len(tokenizer)) > vocab_size:
        raise ModelLoadError(
            f"{tokenizer_path}: the tokenizer has {n} tokens, more than the model's vocabulary ({vocab_size}, "
            f"{model_path}); use the tokenizer the model was trained with"
        )


def check_training_inputs(cfg, vocab_size: int) -> None:
    """Everything ``grpo train`` reads before its first step: model weights, tokenizer, data files."""
    from grpo_core.rollout.hf import load_tokenizer

    model = cfg.actor_rollout_ref.model
    check_weights(model.path)
    tokenizer_path = model.tokenizer_path or model.path
    if Path(tokenizer_path).expanduser().is_dir():
        tokenizer = load_tokenizer(str(tokenizer_path), model.trust_remote_code)
        check_tokenizer_fits(tokenizer, vocab_size, str(tokenizer_path), str(model.path))
    for path in [*cfg.data.train_files, *cfg.data.val_files]:
        check_data_file(path, cfg.data.prompt_key)
