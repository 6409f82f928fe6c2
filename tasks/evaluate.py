"""Evaluate a model or a training checkpoint on GSM8K: cached on the model's files, the data and the settings."""

import hashlib
import json
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from grpo_core.data.lineage import file_sha256
from grpo_core.evaluation.gsm8k import EvalProgress
from grpo_core.evaluation.run import EvalSettings, evaluate_model
from tasks.retry import transient


def model_fingerprint(model: str) -> str:
    """A hub id as is; a local directory by its files' names, sizes and modification times (cheap, and
    changes when a checkpoint is rewritten). A checkpoint's own exports (``hf/``, ``peft/``) are not part of it."""
    path = Path(model)
    if not path.is_dir():
        return model
    exports = ("hf", "peft")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.relative_to(path).parts[0].startswith(exports))
    listing = [(str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return json.dumps([str(path.resolve()), listing])


def _cache_key(context, parameters) -> str:
    out = Path(parameters["out_dir"])
    parts = [
        model_fingerprint(parameters["model"]),
        file_sha256(parameters["data_file"]),
        json.dumps(parameters["settings"], sort_keys=True),
        str(out.resolve()),
    ]
    return "evaluate-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()


@task(cache_key_fn=_cache_key, persist_result=True, retries=1, retry_delay_seconds=10, retry_condition_fn=transient)
def evaluate_checkpoint(model: str, data_file: str, out_dir: str, settings: dict) -> dict:
    """GSM8K accuracies of ``model`` (hub id, HF directory or checkpoint); records in ``out_dir``; a line per
    generate call in the task's log (questions, tokens/s), and a line before the model load."""
    log, name = get_run_logger(), Path(out_dir).name
    engine, limit = settings["engine"], settings.get("limit")
    questions = f"{limit} questions" if limit else "every question"
    # the model load and the engine's build take a while before the first batch's line: say so
    log.info("evaluate %s: loading %s into the %s engine, then %s of %s", name, model, engine, questions, data_file)

    def progress(now: EvalProgress) -> None:
        log.info(now.line(name))

    result = evaluate_model(model, data_file, out_dir, EvalSettings(**settings), on_batch=progress)
    rate = result.response_tokens / max(result.elapsed_s, 1e-9)
    accuracy = ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items() if k.startswith("accuracy"))
    log.info("evaluate %s: %s (%.0f tokens/s)", name, accuracy, rate)
    table = [{"measure": k, "value": round(v, 6)} for k, v in {**result.metrics, "tokens_per_s": rate}.items()]
    create_table_artifact(table, key="grpo-evaluation", description=f"GSM8K evaluation of {model} on {data_file}")
    return {**result.metrics, "tokens_per_s": rate}
