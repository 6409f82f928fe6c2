"""Prompts for training and validation: verl-schema parquet rows -> chat-templated token ids, in batches.

A batch is a pure function of (seed, step, the rows seen before): epoch ``e`` is a permutation seeded by
``seed + e``, with the rows the start model's training drew moved behind the others, so every rank draws the same
prompts without talking, and a resumed run continues from its data position alone.

A row is known by its ``row_id``: a hash of its chat messages and its ground truth, so the same question is the
same row wherever it sits in the file. A model's own directory (its Hugging Face export) lists the rows its
training drew, its start model's included (``rows_seen.json``); a run from it draws the others first.

A keyword that takes a ``data`` setting (``prompt_key``, ``truncation``, ``shuffle``, ``seed``) defaults to the
schema's (config/defaults.py), as ``filter_overlong`` does to ``data.filter_overlong_prompts``.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_core.config.defaults import SETTING, defaults_from, schema_default
from grpo_core.data.gsm8k import DataError
from grpo_core.data.template_sandbox import render_problem
from grpo_core.records.data import RowsSeen
from grpo_core.records.reader import RecordError, read_json


def check_data_file(path: str | Path, prompt_key: str) -> int:
    """A readable parquet file with the columns training, validation and evaluation read (the chat messages in
    ``prompt_key``, verl's ``data.prompt_key``, and ``reward_model``) and at least one row (read from its footer
    only); its rows."""
    import pyarrow.parquet as pq

    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data file {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(f"{path} is not a readable Parquet file: {reason}") from None
    if missing := [c for c in (prompt_key, "reward_model") if c not in parquet.schema_arrow.names]:
        found = ", ".join(parquet.schema_arrow.names) or "none"
        raise DataError(
            f"{path} has no {'/'.join(missing)} column (columns: {found}); expected verl's schema (see `grpo prepare`)"
        )
    if (rows := parquet.metadata.num_rows) == 0:
        raise DataError(f"{path} has no rows (an empty dataset)")
    return rows


@defaults_from("data")
def load_rows(path: str | Path, limit: int | None = None, prompt_key: str = SETTING) -> list[dict]:
    """Rows of a verl-schema parquet file (``grpo prepare``'s output); DataError if it is not one. The messages in
    column ``prompt_key`` are each row's ``"prompt"`` from here on."""
    import pyarrow.parquet as pq

    check_data_file(path, prompt_key)
    table = _first_rows(pq.ParquetFile(Path(path).expanduser()), limit)
    if prompt_key != "prompt":
        names = [name for name in table.column_names if name != "prompt"]
        table = table.select(names).rename_columns(["prompt" if name == prompt_key else name for name in names])
    return table.to_pylist()


def _first_rows(parquet, limit: int | None):
    """The file's first ``limit`` rows (all: None), read batch by batch: a few rows of a large file cost little."""
    import pyarrow as pa

    if limit is None:
        return parquet.read()
    batches, rows = [], 0
    for batch in parquet.iter_batches(batch_size=max(limit, 1)):
        batches.append(batch)
        rows += batch.num_rows
        if rows >= limit:
            break
    return pa.Table.from_batches(batches).slice(0, limit)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's token ids, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def _shown(value) -> str:
    return f"{type(value).__name__} {repr(value)[:80]}"


@dataclass(frozen=True)
class PromptFit:
    """What becomes of a prompt over ``max_len`` tokens, as in verl: dropped (``data.filter_overlong_prompts``), cut
    (``data.truncation`` left, right or middle) or refused (truncation=error). A prompt of more than ``max_chars``
    characters cannot fit, so it is dropped, cut to ``max_chars`` or refused before it is tokenized: a tokenizer
    given megabytes takes seconds and memory on every rank, or panics."""

    max_len: int
    filter_overlong: bool
    truncation: str
    max_chars: int

    @classmethod
    def of(cls, tokenizer, max_len: int, filter_overlong: bool, truncation: str) -> "PromptFit":
        """``max_chars``: ``max_len`` tokens of the tokenizer's longest (in characters): no text longer fits."""
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        return cls(max_len, filter_overlong, truncation, max_len * longest)

    def ids(self, tokenizer, text: str, where: str) -> list[int] | None:
        """``text``'s token ids fitted to ``max_len``; None when the prompt is dropped."""
        if len(text) > self.max_chars:
            if self.filter_overlong:
                return None
            text = _fit(text, self.max_chars, self.truncation)
            if text is None:
                raise DataError(self._too_long(where))
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])  # as apply_chat_template tokenizes
        if len(ids) <= self.max_len:
            return ids
        if self.filter_overlong:
            return None
        if (fitted := _fit(ids, self.max_len, self.truncation)) is None:
            raise DataError(self._too_long(where))
        return fitted

    def _too_long(self, where: str) -> str:
        return (
            f"{where} has more than data.max_prompt_length={self.max_len} prompt tokens (set "
            "data.filter_overlong_prompts=true or data.truncation=left|right|middle)"
        )


def row_fields(row: dict, where: str, prompt_key: str) -> tuple[list[dict], str]:
    """A row's chat messages and ground truth. A column of the right name holding the wrong type is a DataError
    naming ``where`` (file and row) and the column, not a template error from every rank."""
    messages, reward = row.get("prompt"), row.get("reward_model")
    if not (isinstance(messages, list) and messages and all(_is_message(m) for m in messages)):
        expected = "expected a list of chat messages ({role, content})"
        raise DataError(f"{where}, column {prompt_key}: {expected}, got {_shown(messages)}")
    if not (isinstance(reward, dict) and "ground_truth" in reward):
        raise DataError(f"{where}, column reward_model: expected a struct with a ground_truth, got {_shown(reward)}")
    return messages, str(reward["ground_truth"])


def prompt_text(tokenizer, messages: list[dict], where: str, prompt_key: str) -> str:
    """The chat template's text of ``messages``, ready for the assistant's turn; its failure a DataError."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2's errors, or a TypeError from a message's fields
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        fails = f"the tokenizer's chat template fails on it: {type(e).__name__}: {reason}"
        raise DataError(f"{where}, column {prompt_key}: {fails}") from None


def read_row(tokenizer, row: dict, where: str, prompt_key: str, fit: PromptFit) -> tuple[list[int] | None, str]:
    """What training takes from a row: its prompt's token ids (``fit`` to length; None when it is dropped) and its
    ground truth."""
    messages, ground_truth = row_fields(row, where, prompt_key)
    return fit.ids(tokenizer, prompt_text(tokenizer, messages, where, prompt_key), where), ground_truth


def _is_message(message) -> bool:
    return isinstance(message, dict) and isinstance(message.get("role"), str) and message.get("content") is not None


@defaults_from("data")
def check_prompt_rows(
    path: str | Path,
    tokenizer,
    prompt_key: str = SETTING,
    rows: int = 8,
    max_prompt_length: int = SETTING,
    filter_overlong: bool = schema_default("data.filter_overlong_prompts"),
    truncation: str = SETTING,
) -> None:
    """The first ``rows`` rows of a file through ``read_row``, as ``load_prompts`` reads them: before any rank
    starts, cheaply (a few rows, not the file). The chat template renders them first in a child process, under a
    time and memory limit (template_sandbox.py): a template that never ends is one line here, not a silent hang."""
    path = Path(path).expanduser()
    found = load_rows(path, rows, prompt_key)
    conversations = [row_fields(row, f"{path}: row {n}", prompt_key)[0] for n, row in enumerate(found)]
    if tokenizer is None:
        return
    if (problem := _template_problem(tokenizer, conversations)) is not None:
        number, why = problem
        raise DataError(f"{path}: row {number}, column {prompt_key}: the tokenizer's chat template {why}")
    fit = PromptFit.of(tokenizer, max_prompt_length, filter_overlong, truncation)
    for number, row in enumerate(found):
        read_row(tokenizer, row, f"{path}: row {number}", prompt_key, fit)


def _template_problem(tokenizer, conversations: list[list[dict]]) -> tuple[int, str] | None:
    """(row, why) when the tokenizer's chat template does not finish rendering one of ``conversations`` in
    template_sandbox's limits; None otherwise (a template error is read_row's to report)."""
    try:
        template = tokenizer.get_chat_template()
    except Exception:  # no template: read_row says so
        return None
    variables = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str | list)}
    return render_problem(template, conversations, variables)


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    data_source: str
    ground_truth: str
    index: int  # row number in its file(s), for records
    extra_info: dict | None = None  # the row's extra_info, passed to a custom reward function
    row_id: str = ""  # row_id of its messages and ground truth


SEEN_FILE = "rows_seen.json"  # in a model's directory: {"train_digest", "rows", "rows_seen": [row ids]}


def row_id(messages: list[dict], ground_truth) -> str:
    """A row's identity: 16 hex digits of the SHA-256 of its chat messages and ground truth (not its position)."""
    text = json.dumps([messages, str(ground_truth)], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rows_seen(model_dir: str | Path) -> frozenset[str]:
    """The row ids a model's training drew (its ``rows_seen.json``, typed: records/data.py); none for a model that
    records none. DataError naming the file and the field when it is not a list of row ids."""
    path = Path(model_dir).expanduser() / SEEN_FILE
    if not path.is_file():
        return frozenset()
    try:
        return frozenset(read_json(path, RowsSeen).rows_seen)
    except RecordError as e:
        raise DataError(f"{e}; delete it to count every row as new") from None


def start_rows_seen(model_dir: str | Path, adapter_dir: str | Path | None = None) -> frozenset[str]:
    """The rows a run's start model had seen: its directory's, and with a LoRA adapter to start from (a registry
    adapter's warm start) the adapter's too (they name the rows since, and before, the base)."""
    seen = rows_seen(model_dir)
    return seen | rows_seen(adapter_dir) if adapter_dir else seen


def seen_digest(seen: frozenset[str]) -> str:
    """SHA-256 of a set of row ids: what a checkpoint's data position depends on besides the training set."""
    return hashlib.sha256("\n".join(sorted(seen)).encode()).hexdigest()


def position_data(
    train_files: list[str], model_dir: str | Path, adapter_dir: str | Path | None = None
) -> dict[str, str]:
    """What a data position counts in (a checkpoint's ``data``; checkpoint.check_same_data): the training set's
    ``dataset_digest`` and the digest of the rows the start model (``start_rows_seen``) had seen."""
    from grpo_core.data.lineage import dataset_digest

    seen = start_rows_seen(model_dir, adapter_dir)
    return {"train_digest": dataset_digest(train_files), "seen_sha256": seen_digest(seen)}


def decode_responses(tokenizer, responses: list[list[int]]) -> list[str]:
    """Response texts as ``tokenizer.decode(ids, skip_special_tokens=True)`` gives them, in one call to a fast
    tokenizer's Rust batch decode (threaded) where transformers would not change its output: 512 responses of 256
    tokens took 61.8 ms one by one, 24.5 ms in a batch, on the H200 machine's host (BENCHMARKS.md)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
    return backend.decode_batch(responses, skip_special_tokens=True)


def _fit(ids: list[int] | str, max_len: int, truncation: str) -> list[int] | str | None:
    """``ids`` (token ids, or a text's characters) cut to ``max_len`` as ``truncation`` says; None when it says
    "error"."""
    if len(ids) <= max_len:
        return ids
    if truncation == "left":
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    if truncation == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head) :]
    return None


@defaults_from("data")
def load_prompts(
    files: list[str],
    tokenizer,
    max_prompt_length: int,
    filter_overlong: bool = schema_default("data.filter_overlong_prompts"),
    truncation: str = SETTING,
    limit: int | None = None,
    prompt_key: str = SETTING,
) -> tuple[list[Prompt], int]:
    """(prompts, number dropped for length). Overlong prompts are dropped (``filter_overlong``), cut
    (``truncation``), or rejected with a DataError naming the first one (PromptFit)."""
    prompts, dropped = [], 0
    fit = PromptFit.of(tokenizer, max_prompt_length, filter_overlong, truncation)
    for path in files:
        for number, row in enumerate(load_rows(path, limit, prompt_key)):
            ids, ground_truth = read_row(tokenizer, row, f"{path}: row {number}", prompt_key, fit)
            if ids is None:
                dropped += 1
                continue
            prompts.append(
                Prompt(
                    ids=ids,
                    data_source=row.get("data_source") or "",
                    ground_truth=ground_truth,
                    index=len(prompts) + dropped,
                    extra_info=row.get("extra_info"),
                    row_id=row_id(row["prompt"], ground_truth),
                )
            )
    if not prompts:
        raise DataError(f"no usable prompts in {files} ({dropped} longer than data.max_prompt_length)")
    return prompts, dropped


class PromptSampler:
    """``batch(step)``: the prompts of training step ``step`` (0-based); incomplete tail batches are dropped.

    Each epoch's order is its seeded permutation with the rows in ``seen`` (those the start model's training drew)
    moved behind the others, each part keeping its permuted order: new rows come first, and each is drawn once
    in every epoch (the dropped tail holds seen rows while there are enough of them). With nothing seen it is the
    seeded permutation itself."""

    @defaults_from("data")
    def __init__(
        self, prompts: list[Prompt], batch_size: int, shuffle: bool = SETTING, seed: int = SETTING, seen=frozenset()
    ):
        if batch_size > len(prompts):
            raise DataError(f"data.train_batch_size={batch_size} is more than the {len(prompts)} training prompts")
        self.prompts, self.batch_size, self.shuffle, self.seed = prompts, batch_size, shuffle, seed
        self.seen = frozenset(seen)
        self.steps_per_epoch = len(prompts) // batch_size
        self.new_rows = sum(p.row_id not in self.seen for p in prompts)

    def order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s prompt indices: the rows not seen, then the seen ones, each in the permutation's order."""
        order = list(range(len(self.prompts)))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(len(self.prompts), generator=generator).tolist()
        if self.seen:
            seen = {i for i in order if self.prompts[i].row_id in self.seen}
            order = [i for i in order if i not in seen] + [i for i in order if i in seen]
        return order

    def batch(self, step: int) -> list[Prompt]:
        epoch, position = divmod(step, self.steps_per_epoch)
        first = position * self.batch_size
        return [self.prompts[i] for i in self.order(epoch)[first : first + self.batch_size]]

    def drawn(self, position: int) -> set[str]:
        """The row ids of the first ``position`` batches (a data position): the rows a run that far has seen."""
        full, rest = divmod(position, self.steps_per_epoch)
        every = {p.row_id for p in self.prompts}
        ids: set[str] = set()
        for epoch in range(full + 1):
            take = self.steps_per_epoch * self.batch_size if epoch < full else rest * self.batch_size
            ids.update(self.prompts[i].row_id for i in self.order(epoch)[:take])
            if ids == every:
                break
        return ids
