"""Evaluate a model on a GSM8K parquet: a hub id, a Hugging Face directory or a training checkpoint.

The body of ``grpo evaluate`` and of the pipeline's evaluate task. A checkpoint is first exported to a
Hugging Face directory next to it (``<checkpoint>/hf``), in a child process because the export sets up
torch.distributed, which a long-lived caller (a Prefect worker) should not inherit.
"""

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from grpo_core.checkpoint.manager import HF_EXPORT, STATE_FILE, CheckpointError, verify_checkpoint
from grpo_core.config.defaults import SETTING, defaults_from
from grpo_core.data.lineage import dataset_digest
from grpo_core.evaluation.gsm8k import EvalProgress, EvalResult, evaluate, write_eval_set, write_results
from grpo_core.models.adapter import ADAPTER_CONFIG, AdapterError, is_adapter_dir, read_adapter
from grpo_core.rollout import EngineRequest, build_engine

PEFT_EXPORT = "peft"  # a LoRA checkpoint's PEFT adapter directory, beside its merged ``hf``: what the registry versions


@dataclass(frozen=True)
@defaults_from("evaluation", "actor_rollout_ref.model", "data")
class EvalSettings:
    """The ``evaluation.*`` settings and the few others an evaluation reads; each SETTING is the schema's default of
    its name (``evaluation`` first). The others are evaluation's own: k values, float32, a 1024-token prompt."""

    n: int = SETTING
    temperature: float = SETTING
    max_new_tokens: int = SETTING
    batch_size: int = SETTING  # sequences per generate call (prompts x n)
    limit: int | None = SETTING
    k_values: tuple[int, ...] = (1,)
    dtype: str = "float32"  # from_config: evaluation.dtype, whose null resolves by device
    trust_remote_code: bool = SETTING  # actor_rollout_ref.model.trust_remote_code
    engine: str = SETTING  # "hf" or "static" (dense Llama/Qwen2/Qwen3)
    max_prompt_length: int = 1024  # the static engine's cache holds this + max_new_tokens per sequence
    prompt_key: str = SETTING  # the data's column of chat messages (data.prompt_key)

    @classmethod
    def from_config(cls, cfg) -> "EvalSettings":
        e = cfg.evaluation
        dtype = e.dtype or ("float32" if cfg.trainer.device == "cpu" else "bfloat16")
        trust = cfg.actor_rollout_ref.model.trust_remote_code
        return cls(
            e.n,
            e.temperature,
            e.max_new_tokens,
            e.batch_size,
            e.limit,
            dtype=dtype,
            trust_remote_code=trust,
            engine=e.engine,
            max_prompt_length=cfg.data.max_prompt_length,
            prompt_key=cfg.data.prompt_key,
        )


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def exported_model(checkpoint: str | Path, peft: bool = False) -> Path:
    """``<checkpoint>/hf``: written with the checkpoint (save_contents' hf_model), else by ``grpo export`` now.
    With ``peft``: a LoRA checkpoint's adapter directory, ``<checkpoint>/peft`` (``grpo export --peft``)."""
    checkpoint = Path(checkpoint)
    verify_checkpoint(checkpoint)  # also when exported before: the export is only as good as the checkpoint
    name, done_file = (PEFT_EXPORT, ADAPTER_CONFIG) if peft else (HF_EXPORT, "config.json")
    out = checkpoint / name
    if (out / done_file).is_file():
        return out
    partial = checkpoint / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    done = subprocess.run(
        [sys.executable, "-m", "grpo_core.cli", "export", str(checkpoint), str(partial), *(["--peft"] if peft else [])],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("error: ")
        raise CheckpointError(f"exporting {checkpoint} failed: {last}")
    partial.rename(out)
    return out


def refuse_adapter_dir(path: str) -> None:
    """A PEFT adapter directory is not a model: its files' own problem first (records/adapter.py), else where its
    merged model comes from. AdapterError or RecordError either way."""
    adapter = read_adapter(path)
    raise AdapterError(
        f"{path}: a PEFT LoRA adapter (of {adapter.base_model}), not a model; evaluate the checkpoint it was "
        "exported from (`grpo evaluate --model CHECKPOINT` merges it) or its registered version (models:/NAME/N)"
    )


def engine_request(model: str, tokenizer, settings: EvalSettings, device: str) -> EngineRequest:
    """What ``settings.engine`` is built from (``rollout.build_engine``), its weights loaded from ``model``; the
    static engine raises ModelLoadError for a model it cannot run."""
    return EngineRequest(
        model,
        tokenizer,
        dtype=settings.dtype,
        device=device,
        max_batch_size=settings.batch_size,
        max_model_len=settings.max_prompt_length + settings.max_new_tokens,  # the static engine's cache
        trust_remote_code=settings.trust_remote_code,
        setting="evaluation.engine",
        alternatives="hf",
    )


def evaluate_model(
    model: str,
    data_file: str,
    out_dir: str | Path,
    settings: EvalSettings,
    on_batch: Callable[[EvalProgress], None] | None = None,
) -> EvalResult:
    """Greedy (or sampled) answers for the first ``settings.limit`` rows; writes samples.jsonl and metrics.json.
    ``on_batch(progress)`` after each generate call (questions and tokens so far).

    Raises DataError, ModelLoadError or CheckpointError for unusable input."""
    import torch

    from grpo_core.cpu_memory import keep_freed_memory
    from grpo_core.data.gsm8k import DataError
    from grpo_core.data.prompts import chat_prompt_ids, check_data_file, load_rows
    from grpo_core.models.shape import read_hf_config
    from grpo_core.preflight import check_tokenizer_fits, check_weights
    from grpo_core.rollout.hf import ModelLoadError, load_tokenizer

    check_data_file(data_file, settings.prompt_key)  # before a checkpoint's export, which takes a while
    if is_adapter_dir(model):
        refuse_adapter_dir(model)
    if is_checkpoint(model):
        model = str(exported_model(model))
    check_weights(model, ("*.safetensors", "pytorch_model*.bin"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # as a CPU rank does: each decode step's logits and sampling buffers reuse freed pages
        keep_freed_memory()
    rows = load_rows(data_file, settings.limit, settings.prompt_key)
    if not rows:
        raise DataError(f"{data_file} has no rows")
    tokenizer = load_tokenizer(model, settings.trust_remote_code)
    if Path(model).is_dir() and isinstance(vocab := read_hf_config(model).get("vocab_size"), int):
        check_tokenizer_fits(tokenizer, vocab, model, model)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"the tokenizer of {model} has no chat template; evaluate needs a chat model")
    if settings.engine == "static":  # its cache must hold the longest prompt: no question is left out
        longest = max(len(chat_prompt_ids(tokenizer, row["prompt"])) for row in rows)
        settings = replace(settings, max_prompt_length=max(settings.max_prompt_length, longest))
    engine = build_engine(settings.engine, engine_request(model, tokenizer, settings, device))
    result = evaluate(
        engine,
        tokenizer,
        rows,
        n=settings.n,
        temperature=settings.temperature,
        max_new_tokens=settings.max_new_tokens,
        batch_size=max(1, settings.batch_size // settings.n),  # batch_size counts sequences
        k_values=settings.k_values,
        on_batch=on_batch,
    )
    result.device = device
    try:
        write_results(result, out_dir)
        write_eval_set(out_dir, dataset_digest([data_file]), result.records)  # the questions, for a fixed judge
    except OSError as e:
        raise DataError(f"cannot write to output directory {out_dir}: {e.strerror or e}") from None
    return result
