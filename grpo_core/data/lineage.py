"""Which data a model was trained and judged on: one digest per dataset, and the record ``prepare`` writes.

``dataset_digest`` is the one name every place gives a dataset: the prepare record beside the parquet files,
the MLflow run's dataset inputs (training and evaluation), the registered version's tags. It hashes the
files' contents only, so a copied or moved directory keeps its digest, and it is cut to 32 hex characters
(128 bits) because MLflow keeps at most 36 characters of a dataset's digest: the same value fits everywhere.

The prepare record is ``manifest.json`` in the output directory (grpo_core/data/gsm8k.py writes it last,
atomically): where the rows came from (``source``, ``source_kind``, ``revision``, ``source_files`` with their
sha256), the rows kept and skipped per split, and ``digests``, each prepared file's ``dataset_digest``.
"""

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from grpo_core.records.data import DataManifest
from grpo_core.records.reader import read_json

RECORD = "manifest.json"
DIGEST_CHARS = 32  # MLflow's dataset digest column holds 36


def file_sha256(path: str | Path) -> str:
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def dataset_digest(paths: Iterable[str | Path]) -> str:
    """SHA-256 over the files' own SHA-256s, in the order given (the order a trainer reads them in), cut to
    ``DIGEST_CHARS`` hex characters. Names and locations do not count: only the bytes."""
    return _combined(file_sha256(p) for p in paths)


def _combined(sha256s: Iterable[str]) -> str:
    return hashlib.sha256("".join(f"{s}\n" for s in sha256s).encode()).hexdigest()[:DIGEST_CHARS]


def record_text(record: dict, outputs: dict[str, Path]) -> str:
    """The prepare record as written: ``record`` (source, rows, ...) with each output's ``sha256`` and ``digests``
    entry. ``outputs`` maps each prepared file's name to where its bytes are now (a temporary file before the
    rename: neither hash depends on the name)."""
    sha256 = {name: file_sha256(path) for name, path in outputs.items()}
    digests = {name: _combined([sha]) for name, sha in sha256.items()}
    return json.dumps({**record, "sha256": sha256, "digests": digests}, indent=2) + "\n"


def read_record(directory: str | Path) -> dict | None:
    """The prepare record in ``directory`` (typed: records/data.py), or None when there is none, or the file is
    another tool's (an object without ``format_version``). RecordError naming the field when it is not of its
    schema: what a record says of the data (its digests, rows, source) is read back into every run's lineage."""
    path = Path(directory) / RECORD
    if not path.is_file():
        return None
    record = read_json(path, DataManifest)
    return record.model_dump(exclude_unset=True) if record.format_version is not None else None


def record_of(path: str | Path) -> dict | None:
    """What the record beside a prepared file says of it (``split``, ``rows``, ``skipped``, ``source``,
    ``source_kind``, ``revision``, ``digest``), when it lists that file with the digest it has now; None for a
    file ``prepare`` did not write, or one changed since."""
    path = Path(path)
    record = read_record(path.parent)
    if record is None or not path.is_file():
        return None
    digest, split = (record.get("digests") or {}).get(path.name), path.stem
    if digest is None or digest != dataset_digest([path]):
        return None
    fields = {k: record.get(k) for k in ("source", "source_kind", "revision", "data_source")}
    rows, skipped = record.get("rows") or {}, record.get("skipped") or {}
    return fields | {"split": split, "rows": rows.get(split), "skipped": skipped.get(split), "digest": digest}
