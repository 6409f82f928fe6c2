"""Records of data: the rows a model's training drew (``rows_seen.json``), the questions an evaluation asked
(``eval_set.json``) and what ``grpo prepare`` wrote (its ``manifest.json``)."""

from typing import Annotated, Literal

from pydantic import Field

from grpo_core.records.reader import Count, Digest, Hex64, Name, Record, RowId


class RowsSeen(Record):
    """``rows_seen.json`` in a model's directory (models/bridge.py write_rows_seen; data/prompts.py rows_seen)."""

    what = "list of rows seen"
    max_bytes = 256 << 20

    rows_seen: list[RowId]
    train_digest: Digest | None = None
    rows: Count | None = None


class EvalSet(Record):
    """``eval_set.json`` beside an evaluation's records (evaluation/gsm8k.py write_eval_set): the data's digest and
    the questions asked, by row id (or by position, for records from before row ids)."""

    what = "evaluation set"
    max_bytes = 64 << 20

    data_digest: Digest
    questions: list[Annotated[str, Field(min_length=1, max_length=64)]]


class DataManifest(Record):
    """``manifest.json`` of prepared data (data/gsm8k.py, data/lineage.py). Fields came over time: a record from
    before one was added lacks it (and is rebuilt by the next prepare)."""

    what = "prepare record"
    max_bytes = 16 << 20

    format_version: Annotated[int, Field(ge=1, le=1 << 16)] | None = None  # None: not a prepare record
    data_source: Name | None = None
    source: Name | None = None
    source_kind: Literal["hub", "local", "embedded"] | None = None
    revision: Name | None = None
    source_files: dict[Name, Hex64] | None = None
    input_hash: Hex64 | None = None
    created: Annotated[str, Field(max_length=64)] | None = None
    rows: dict[Name, Count] | None = None
    skipped: dict[Name, Count] | None = None
    sha256: dict[Name, Hex64] | None = None
    digests: dict[Name, Digest] | None = None
