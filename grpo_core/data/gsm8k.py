"""GSM8K to verl-schema parquet: the files the trainer and evaluator read.

``prepare_gsm8k`` converts the raw dataset (a hub id, a local directory or the embedded sample) into
``train.parquet`` and ``test.parquet`` plus a ``manifest.json`` recording what went in (the source, its
revision and files, the rows kept and skipped, each output's digest: grpo_core/data/lineage.py). The manifest is
written last, so a directory with a manifest is complete, and an unchanged input is not converted twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import track

from grpo_core.data.lineage import RECORD, file_sha256, read_record, record_text
from grpo_core.quiet import quiet_datasets
from grpo_core.rewards.gsm8k import extract_solution

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
FORMAT_VERSION = 1
"""Bump whenever ``make_row``'s output changes, so old outputs are rebuilt rather than reused."""
SPLITS = ("train", "test")
EMBEDDED = "embedded"
MANIFEST = RECORD
RECORD_KEYS = {"rows", "skipped", "source_kind", "digests"}
"""A manifest without one of these was written before it was recorded: the output is rebuilt."""
PATTERNS = ("{}.jsonl", "{}.parquet", "{}-*.parquet", "main/{}-*.parquet")
"""Looked for per split in a local directory; the last two match a hub snapshot of openai/gsm8k."""

_S = pa.string()
SCHEMA = pa.schema(
    {
        "data_source": _S,
        "prompt": pa.list_(pa.struct({"role": _S, "content": _S})),
        "ability": _S,
        "reward_model": pa.struct({"style": _S, "ground_truth": _S}),
        "extra_info": pa.struct({"split": _S, "index": pa.int64(), "question": _S, "answer": _S}),
    }
)


class DataError(Exception):
    """The input cannot be used; the message is one line meant for the user."""


@dataclass(frozen=True)
class PrepareResult:
    output_dir: Path
    rows: dict[str, int]
    skipped: dict[str, int]
    input_hash: str
    reused: bool


def make_row(question: str, answer: str, split: str, index: int) -> dict | None:
    """One example in verl's RL schema, or None when the answer has no ``#### N`` to grade against."""
    if not isinstance(question, str) or not isinstance(answer, str):
        return None
    ground_truth = extract_solution(answer, "strict")
    if ground_truth is None:
        return None
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def _short(exc: BaseException) -> str:
    """The first line of the root cause: library errors are often wrapped and multi-line."""
    cause = exc.__cause__ or exc
    return (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]


def _source_files(source: str, out_dir: Path, stack: contextlib.ExitStack) -> dict[str, list[Path]]:
    """Each split's input files, found (or reported missing) before anything is loaded; {} for a hub id."""
    if source == EMBEDDED:
        root = resources.files("grpo_core.data") / "embedded"
        return {s: [stack.enter_context(resources.as_file(root / f"gsm8k_{s}.jsonl"))] for s in SPLITS}
    directory = Path(source).expanduser()
    if not (directory.exists() or source.startswith((".", "/", "~")) or source.count("/") > 1):
        return {}  # hub ids look like "name" or "owner/name"; anything else path-like is local
    if not directory.is_dir():
        problem = "is not a directory" if directory.exists() else "does not exist"
        raise DataError(f"dataset directory {directory} {problem}")
    if out_dir.resolve() == directory.resolve():
        raise DataError(f"output directory {out_dir} must differ from the source directory")
    files = {}
    for split in SPLITS:
        found = [sorted(directory.glob(p.format(split))) for p in PATTERNS]
        if not any(found):
            looked = ", ".join(p.format(split) for p in PATTERNS)
            raise DataError(f"no {split} file in {directory} (looked for {looked})")
        files[split] = next(paths for paths in found if paths)
    return files


def _first_bad_json_line(path: Path) -> int | None:
    """Only called after a load failed, so the normal path never reads the file twice."""
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                if line.strip() and not isinstance(json.loads(line), dict):
                    return number
            except ValueError:
                return number
    return None


def _check_text(path: Path) -> None:
    """A JSON lines file is UTF-8 and not empty: datasets loads bytes that are not UTF-8 (the conversion then fails
    on them) and says only "StopIteration" of an empty file."""
    empty = True
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = f"byte 0x{line[e.start]:02x}, the line's byte {e.start + 1}"
                raise DataError(f"{path}: line {number} is not UTF-8 text ({bad}); save the file as UTF-8") from None
            empty = empty and not line.strip()
    if empty:
        raise DataError(f"{path} is empty: no JSON lines")


def _load_local(files: dict[str, list[Path]]) -> dict[str, datasets.Dataset]:
    import datasets

    loaded = {}
    for split, paths in files.items():
        fmt = "parquet" if paths[0].suffix == ".parquet" else "json"
        if fmt == "json":
            _check_text(paths[0])  # .jsonl is one file
        try:
            loaded[split] = datasets.load_dataset(fmt, data_files={split: list(map(str, paths))}, split=split)
        except Exception as exc:
            bad_line = _first_bad_json_line(paths[0]) if fmt == "json" else None  # .jsonl is one file
            reason = f"line {bad_line} is not a JSON object" if bad_line else _short(exc)
            kind = "Parquet" if fmt == "parquet" else "JSON lines"
            raise DataError(f"{', '.join(map(str, paths))} is not valid {kind}: {reason}") from exc
    return loaded


def _load_hub(source: str) -> dict[str, datasets.Dataset]:
    import datasets

    try:
        loaded = datasets.load_dataset(source, "main")
    except Exception as exc:
        raise DataError(
            f"could not load {source!r} from the Hugging Face hub (offline?): {_short(exc)}; "
            "pass a local directory with train.jsonl/test.jsonl instead"
        ) from exc
    if missing := [s for s in SPLITS if s not in loaded]:
        raise DataError(f"{source!r} on the Hugging Face hub has no {'/'.join(missing)} split")
    return {s: loaded[s] for s in SPLITS}


def _convert(ds: datasets.Dataset, split: str, source: str, progress: bool) -> tuple[pa.Table, list[int]]:
    """Whole columns are pulled out at once; only the cheap per-row dict building runs in Python."""
    if missing := sorted({"question", "answer"} - set(ds.column_names)):
        found = ", ".join(ds.column_names)
        raise DataError(f"{split} split of {source} has no {'/'.join(missing)} column (columns: {found})")
    columns = ds.select_columns(["question", "answer"]).to_dict()
    pairs = zip(columns["question"], columns["answer"], strict=True)
    bar = track(pairs, f"gsm8k {split}", total=len(ds), disable=not progress, console=Console(stderr=True))
    made = [make_row(question, answer, split, index) for index, (question, answer) in enumerate(bar)]
    skipped = [index for index, row in enumerate(made) if row is None]
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        logger.warning(
            "gsm8k %s: skipped %d rows with no parsable final answer (indices %s)", split, len(skipped), shown
        )
    return pa.Table.from_pylist([row for row in made if row is not None], schema=SCHEMA), skipped


def _temp_path(directory: Path, name: str) -> Path:
    """Hidden and ending in .tmp, so a leftover is never mistaken for an output."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the outputs private once renamed
    return Path(tmp)


def _write_outputs(out_dir: Path, tables: dict[str, pa.Table], manifest: dict) -> None:
    """Every new file is complete before any old one is replaced; the manifest goes last."""
    temps: dict[str, Path] = {}
    try:
        for split, table in tables.items():
            tmp = temps[f"{split}.parquet"] = _temp_path(out_dir, f"{split}.parquet")
            pq.write_table(table, tmp)
        outputs = dict(temps)
        temps[MANIFEST] = _temp_path(out_dir, MANIFEST)
        temps[MANIFEST].write_text(record_text(manifest, outputs))
        (out_dir / MANIFEST).unlink(missing_ok=True)  # from here on the old output is no longer complete
        for name, tmp in temps.items():
            os.replace(tmp, out_dir / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def _reusable(out_dir: Path, input_hash: str) -> dict | None:
    """The existing manifest, if it describes this input and its files are still exactly as written."""
    try:
        manifest = read_record(out_dir) or {}
        digests = manifest["sha256"]
        same_input = (manifest["format_version"], manifest["input_hash"]) == (FORMAT_VERSION, input_hash)
        complete = set(digests) == {f"{s}.parquet" for s in SPLITS} and manifest.keys() >= RECORD_KEYS
        intact = same_input and complete and all(file_sha256(out_dir / n) == d for n, d in digests.items())
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return manifest if intact else None


def _input_hash(source: str, files: dict[str, list[Path]], hub: dict | None) -> str:
    if files:
        parts = [f"{split}:{file_sha256(p)}" for split, paths in files.items() for p in paths]
    else:
        parts = [source, "main", *(hub[s]._fingerprint for s in SPLITS)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _hub_files(source: str) -> tuple[str | None, dict[str, str]]:
    """The hub dataset's commit and the sha256 of its ``main/`` files; (None, {}) when the hub does not say
    (offline, with the data in the local cache): the record then names the dataset only."""
    try:
        from huggingface_hub import HfApi

        info = HfApi().dataset_info(source, files_metadata=True)
    except Exception as exc:  # noqa: BLE001  (any hub or network error: the data itself was loaded)
        logger.warning("gsm8k: %s: the hub did not say which revision was loaded (%s)", source, _short(exc))
        return None, {}
    siblings = [s for s in info.siblings or [] if s.rfilename.startswith("main/") and s.lfs is not None]
    return info.sha, {s.rfilename: s.lfs.sha256 for s in siblings}


def _origin(source: str, files: dict[str, list[Path]]) -> dict:
    """Where the rows came from, for the record: kind, revision (the hub's commit) and each source file's sha256."""
    if not files:
        revision, hashes = _hub_files(source)
        return {"source_kind": "hub", "revision": revision, "source_files": hashes}
    root = None if source == EMBEDDED else Path(source).expanduser()
    named = {(str(p.relative_to(root)) if root else p.name): p for paths in files.values() for p in paths}
    hashes = {name: file_sha256(path) for name, path in named.items()}
    return {"source_kind": EMBEDDED if root is None else "local", "revision": None, "source_files": hashes}


def input_hash(source: str, output_dir: str | Path) -> str:
    """The hash ``prepare_gsm8k`` keys its reuse on: the input files' digests, or the hub dataset's fingerprint."""
    with contextlib.ExitStack() as stack:
        files = _source_files(source, Path(output_dir).expanduser(), stack)
        return _input_hash(source, files, None if files else _load_hub(source))


def prepare_gsm8k(source: str, output_dir: str | Path, force: bool = False, progress: bool = True) -> PrepareResult:
    """Write verl-schema GSM8K parquet files into ``output_dir``, or reuse them if the input is unchanged.

    ``source`` is a hub dataset id (e.g. ``openai/gsm8k``), a local directory with train/test
    ``.jsonl`` or ``.parquet`` files, or ``"embedded"`` for the small sample shipped with the package.
    Raises DataError for unusable input; on any error the previous contents of ``output_dir`` survive.
    """
    out_dir = Path(output_dir).expanduser()
    with contextlib.ExitStack() as stack:
        import datasets

        quiet_datasets()  # its records once, through the routing of quiet.py
        if not progress and not datasets.are_progress_bars_disabled():
            datasets.disable_progress_bars()
            stack.callback(datasets.enable_progress_bars)
        files = _source_files(source, out_dir, stack)
        hub = None if files else _load_hub(source)
        input_hash = _input_hash(source, files, hub)

        if not force and (old := _reusable(out_dir, input_hash)) is not None:
            logger.info("gsm8k: %s is up to date (input unchanged), reusing it", out_dir)
            return PrepareResult(out_dir, old["rows"], old["skipped"], input_hash, reused=True)
        loaded = _load_local(files) if files else hub
        converted = {split: _convert(loaded[split], split, source, progress) for split in SPLITS}
        origin = _origin(source, files)

    rows = {split: table.num_rows for split, (table, _) in converted.items()}
    skipped = {split: len(indices) for split, (_, indices) in converted.items()}
    created = datetime.now(UTC).isoformat(timespec="seconds")
    manifest = {"format_version": FORMAT_VERSION, "data_source": DATA_SOURCE, "source": source, **origin}
    manifest |= {"input_hash": input_hash, "created": created, "rows": rows, "skipped": skipped}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_outputs(out_dir, {split: table for split, (table, _) in converted.items()}, manifest)
    except OSError as exc:
        raise DataError(f"cannot write to output directory {out_dir}: {exc.strerror or exc}") from exc
    logger.debug("gsm8k: wrote %s to %s", ", ".join(f"{n} {s} rows" for s, n in rows.items()), out_dir)
    return PrepareResult(out_dir, rows, skipped, input_hash, reused=False)
