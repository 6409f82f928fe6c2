"""Prepare GSM8K: cached on the input's hash (and the output still being there)."""

import hashlib
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from grpo_core.data import gsm8k
from grpo_core.data.lineage import record_of
from tasks.retry import transient


def _cache_key(context, parameters) -> str:
    source, out = parameters["source"], Path(parameters["output_dir"]).resolve()
    return "prepare-" + hashlib.sha256(f"{gsm8k.input_hash(source, out)}\0{out}".encode()).hexdigest()


@task(cache_key_fn=_cache_key, persist_result=True, retries=2, retry_delay_seconds=10, retry_condition_fn=transient)
def prepare_gsm8k(source: str, output_dir: str) -> dict:
    """The hub, a local copy or the embedded sample → verl-schema parquet; row counts per split."""
    result = gsm8k.prepare_gsm8k(source, output_dir, progress=False)
    rows = [record_of(Path(result.output_dir) / f"{split}.parquet") or {"split": split} for split in result.rows]
    table = [{k: r.get(k) for k in ("split", "rows", "skipped", "digest", "source")} for r in rows]
    create_table_artifact(table, key="grpo-data", description=f"GSM8K prepared in {result.output_dir}: rows kept "
                          "and skipped per split, each file's dataset digest")  # fmt: skip
    return {"output_dir": str(result.output_dir), "rows": result.rows, "input_hash": result.input_hash}
