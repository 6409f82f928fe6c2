"""Checks of the input files (and of the Prefect API a pipeline is pointed at) that can be made before any process
(or process group) starts, so that a bad file costs one ``error:`` line naming it instead of a traceback from every
rank minutes later.

Each check raises the error class its caller already turns into that line: ModelShapeError for the model
directory, ModelLoadError for the tokenizer, DataError for a data file.
"""

import json
import os
import struct
from pathlib import Path

from grpo_core.data.prompts import check_data_file, check_prompt_rows
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


def prefect_api_problem(timeout_s: float = 5.0) -> str | None:
    """Why the Prefect API that PREFECT_API_URL (or the Prefect profile) names cannot be used, else None (none named:
    the flow starts Prefect's ephemeral API). Any HTTP answer will do; silence (refused, unreachable, timed out) is
    found here in seconds, before the run directory is written, not as the flow engine's chained traceback."""
    import httpx
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        return None
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout_s)
    except (httpx.TransportError, httpx.InvalidURL) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        unset = "unset PREFECT_API_URL" if "PREFECT_API_URL" in os.environ else "`prefect config unset PREFECT_API_URL`"
        return (
            f"the Prefect API at {url} does not answer ({reason}); {unset} to run on Prefect's ephemeral API, "
            "or start that server (`prefect server start`)"
        )
    return None


def check_training_inputs(cfg, vocab_size: int) -> None:
    """Everything ``grpo train`` reads before its first step: model weights, tokenizer, data files (the first rows
    of each through the chat template, as the ranks will read them)."""
    from grpo_core.rollout.hf import load_tokenizer

    model = cfg.actor_rollout_ref.model
    check_weights(model.path)
    tokenizer_path, tokenizer = model.tokenizer_path or model.path, None  # a hub id's: downloaded by the ranks
    if Path(tokenizer_path).expanduser().is_dir():
        tokenizer = load_tokenizer(str(tokenizer_path), model.trust_remote_code)
        check_tokenizer_fits(tokenizer, vocab_size, str(tokenizer_path), str(model.path))
    d = cfg.data
    for path in [*d.train_files, *d.val_files]:
        check_data_file(path, d.prompt_key)
    for path in d.train_files:  # as the ranks read them (trainer/setup.py): validation prompts over length are dropped
        check_prompt_rows(
            path, tokenizer, d.prompt_key, 8, d.max_prompt_length, d.filter_overlong_prompts, d.truncation
        )
    for path in d.val_files:
        check_prompt_rows(path, tokenizer, d.prompt_key, max_prompt_length=d.max_prompt_length)
