"""Tests for GSM8K preparation: verl-schema output, reuse, skipped rows, errors and atomic writes."""

import json
import os
import shutil
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_core.data import gsm8k
from grpo_core.data.gsm8k import DataError, PrepareResult, prepare_gsm8k

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
EMBEDDED_DIR = Path(gsm8k.__file__).parent / "embedded"
OUTPUTS = {"manifest.json", "train.parquet", "test.parquet"}


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Keep the arrow caches datasets builds for tmp inputs out of the user's ~/.cache."""
    cache = tmp_path_factory.getbasetemp() / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)


def prepare(source: str | Path, out: Path, **kwargs) -> PrepareResult:
    return prepare_gsm8k(str(source), out, progress=False, **kwargs)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def small_source(tmp_path: Path) -> Path:
    """A local copy of the embedded sample, which tests may modify."""
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        shutil.copy(EMBEDDED_DIR / f"gsm8k_{split}.jsonl", src / f"{split}.jsonl")
    return src


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> tuple[PrepareResult, Path]:
    if not SHARED_GSM8K.is_dir():
        pytest.skip(f"full GSM8K not available at {SHARED_GSM8K} (the shared data folder is absent)")
    out = tmp_path_factory.mktemp("full")
    cache = tmp_path_factory.getbasetemp() / "hf_datasets_cache"
    with pytest.MonkeyPatch.context() as mp:  # module scope cannot use the autouse fixture
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        return prepare(SHARED_GSM8K, out), out


def test_full_dataset_rows_and_ground_truth(full: tuple[PrepareResult, Path]) -> None:
    result, out = full
    assert not result.reused
    assert result.rows == {"train": 7473, "test": 1319}
    assert result.skipped == {"train": 0, "test": 0}
    train = pq.read_table(out / "train.parquet").to_pylist()
    test = pq.read_table(out / "test.parquet").to_pylist()
    assert (len(train), len(test)) == (7473, 1319)

    assert train[0]["extra_info"]["question"].startswith("Natalia sold clips")
    assert train[0]["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert test[0]["extra_info"]["question"].startswith("Janet\u2019s ducks")
    assert test[0]["reward_model"]["ground_truth"] == "18"
    assert train[345]["extra_info"]["question"].startswith("Adam earns $40 daily")
    assert train[345]["extra_info"]["answer"].endswith("#### 1,080")
    assert train[345]["reward_model"]["ground_truth"] == "1080"
    assert train[367]["reward_model"]["ground_truth"] == "850000"  # "#### 850,000"

    question = train[0]["extra_info"]["question"]
    assert train[0]["prompt"] == [
        {
            "role": "user",
            "content": question + ' Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert train[0]["data_source"] == "openai/gsm8k"
    assert train[0]["ability"] == "math"
    assert train[0]["extra_info"]["split"] == "train"
    assert test[5]["extra_info"]["split"] == "test"
    assert [row["extra_info"]["index"] for row in train[:3]] == [0, 1, 2]


def test_full_dataset_schema(full: tuple[PrepareResult, Path]) -> None:
    _, out = full
    for split in ("train", "test"):
        schema = pq.read_schema(out / f"{split}.parquet")
        assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        prompt = schema.field("prompt").type
        assert pa.types.is_list(prompt)
        assert [f.name for f in prompt.value_type] == ["role", "content"]
        assert [f.name for f in schema.field("reward_model").type] == ["style", "ground_truth"]
        extra = schema.field("extra_info").type
        assert [f.name for f in extra] == ["split", "index", "question", "answer"]
        assert extra.field("index").type == pa.int64()

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == {"train": 7473, "test": 1319}
    assert manifest["source"] == str(SHARED_GSM8K)
    assert set(manifest["sha256"]) == {"train.parquet", "test.parquet"}
    assert {"format_version", "input_hash", "created", "skipped"} <= manifest.keys()


def test_make_row() -> None:
    row = gsm8k.make_row("What is 6*7?", "6*7=42\n#### 42", "train", 3)
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 6*7? " + gsm8k.INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {"split": "train", "index": 3, "question": "What is 6*7?", "answer": "6*7=42\n#### 42"},
    }
    assert gsm8k.make_row("q", "the answer is 42", "train", 0) is None
    assert gsm8k.make_row("q", None, "train", 0) is None  # type: ignore[arg-type]


def test_embedded_sample(tmp_path: Path) -> None:
    result = prepare("embedded", tmp_path / "out")
    assert result.rows == {"train": 256, "test": 128}
    assert pq.read_metadata(tmp_path / "out" / "train.parquet").num_rows == 256
    assert set(os.listdir(tmp_path / "out")) == OUTPUTS


def test_unchanged_input_is_reused_and_force_redoes(small_source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = prepare(small_source, out)
    assert not first.reused
    manifest = out / "manifest.json"
    os.utime(manifest, (1_000_000, 1_000_000))  # an mtime no rewrite could keep
    before = snapshot(out)

    second = prepare(small_source, out)
    assert second.reused
    assert (second.rows, second.skipped, second.input_hash) == (first.rows, first.skipped, first.input_hash)
    assert manifest.stat().st_mtime == 1_000_000
    assert snapshot(out) == before

    forced = prepare(small_source, out, force=True)
    assert not forced.reused
    assert manifest.stat().st_mtime != 1_000_000
    assert set(os.listdir(out)) == OUTPUTS


def test_changed_input_is_redone(small_source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = prepare(small_source, out)
    with (small_source / "train.jsonl").open("a") as f:
        f.write(json.dumps({"question": "What is 1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    second = prepare(small_source, out)
    assert not second.reused
    assert second.input_hash != first.input_hash
    assert second.rows == {"train": 257, "test": 128}
    assert pq.read_table(out / "train.parquet").to_pylist()[-1]["reward_model"]["ground_truth"] == "2"


def test_damaged_output_is_redone(small_source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare(small_source, out)
    (out / "test.parquet").write_bytes(b"not what was written")
    assert not prepare(small_source, out).reused
    assert pq.read_metadata(out / "test.parquet").num_rows == 128


def test_rows_without_final_answer_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "src"
    write_jsonl(
        src / "train.jsonl",
        [
            {"question": "q0", "answer": "so 3\n#### 3"},
            {"question": "q1", "answer": "no marker, the answer is 5"},
            {"question": "q2", "answer": "#### 1,234"},
            {"question": "q3", "answer": "#### "},
        ],
    )
    write_jsonl(src / "test.jsonl", [{"question": "t0", "answer": "#### 7"}])
    with caplog.at_level("WARNING", logger="grpo_core.data.gsm8k"):
        result = prepare(src, tmp_path / "out")
    assert result.rows == {"train": 2, "test": 1}
    assert result.skipped == {"train": 2, "test": 0}
    assert "train: skipped 2 rows" in caplog.text and "indices 1, 3" in caplog.text
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [(r["extra_info"]["index"], r["reward_model"]["ground_truth"]) for r in train] == [
        (0, "3"),
        (2, "1234"),
    ]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["skipped"] == {"train": 2, "test": 0}


def test_hub_snapshot_layout_with_parquet(tmp_path: Path) -> None:
    src = tmp_path / "snapshot"
    (src / "main").mkdir(parents=True)
    for split, n in (("train", 5), ("test", 3)):
        rows = [json.loads(line) for line in (EMBEDDED_DIR / f"gsm8k_{split}.jsonl").read_text().splitlines()]
        pq.write_table(pa.Table.from_pylist(rows[:n]), src / "main" / f"{split}-00000-of-00001.parquet")
    assert prepare(src, tmp_path / "out").rows == {"train": 5, "test": 3}


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda src: src / "missing", "does not exist"),
        (lambda src: src, "no train file in"),
        (
            lambda src: write_jsonl(src / "train.jsonl", [{"question": "q", "answer": "#### 1"}]).parent,
            "test.jsonl",
        ),
    ],
    ids=["missing-dir", "empty-dir", "no-test-file"],
)
def test_bad_directories(tmp_path: Path, setup, message: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(DataError, match=message) as info:
        prepare(setup(src), tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_empty_dir_names_the_files_looked_for(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        prepare(tmp_path, tmp_path / "out")
    assert "train.jsonl" in str(info.value) and "train.parquet" in str(info.value)


def test_malformed_jsonl(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_jsonl(src / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    (src / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": oops\n')
    with pytest.raises(DataError, match=r"test\.jsonl is not valid JSON lines: line 2 ") as info:
        prepare(src, tmp_path / "out")
    assert "\n" not in str(info.value)


def test_malformed_parquet(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_jsonl(src / "train.jsonl", [{"question": "q", "answer": "#### 1"}])
    (src / "test.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match=r"test\.parquet is not valid Parquet"):
        prepare(src, tmp_path / "out")


def test_missing_column(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_jsonl(src / "train.jsonl", [{"question": "q", "solution": "#### 1"}])
    write_jsonl(src / "test.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(DataError, match=r"train split of .*/src has no answer column \(columns: question, solution\)"):
        prepare(src, tmp_path / "out")


UNUSABLE = {  # a source file -> what `grpo prepare` says of it (datasets said "StopIteration", or loaded the bytes)
    "not UTF-8": (
        "test.jsonl",
        lambda path: path.write_bytes(
            b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n'
        ),
        lambda path: f"{path}: line 2 is not UTF-8 text (byte 0xe9, the line's byte 18); save the file as UTF-8",
    ),
    "empty": ("train.jsonl", lambda path: path.write_text("\n"), lambda path: f"{path} is empty: no JSON lines"),
}


@pytest.mark.parametrize("case", list(UNUSABLE))
def test_an_unusable_source_file_is_one_line_and_exit_2(case: str, tmp_path: Path, capsys) -> None:
    from grpo_core.cli import main

    name, damage, says = UNUSABLE[case]
    src, out = tmp_path / "src", tmp_path / "out"
    for split in ("train", "test"):
        write_jsonl(src / f"{split}.jsonl", [{"question": "q", "answer": "#### 1"}])
    damage(src / name)
    assert main(["prepare", "--source", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {says(src / name)}"], err
    assert "Traceback" not in err and not out.exists()


def test_unreachable_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore detail")

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        prepare("openai/gsm8k", tmp_path / "out")
    message = str(info.value)
    assert message.startswith("could not load 'openai/gsm8k' from the Hugging Face hub (offline?): Couldn't reach")
    assert message.endswith("pass a local directory with train.jsonl/test.jsonl instead")
    assert "\n" not in message


def test_output_must_not_be_the_source(small_source: Path) -> None:
    with pytest.raises(DataError, match="must differ from the source"):
        prepare(small_source, small_source)


def test_crash_while_writing_keeps_previous_output(
    small_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    prepare(small_source, out)
    before = snapshot(out)
    with (small_source / "train.jsonl").open("a") as f:  # new input, so the next call really rewrites
        f.write(json.dumps({"question": "What is 1+1?", "answer": "#### 2"}) + "\n")

    real_write = gsm8k.pq.write_table

    def crash_on_test(table: pa.Table, where, *args, **kwargs) -> None:
        if Path(where).name.startswith(".test."):
            Path(where).write_bytes(b"half a parquet file")
            raise RuntimeError("simulated crash")
        real_write(table, where, *args, **kwargs)

    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="simulated crash"):
        patch.setattr(gsm8k.pq, "write_table", crash_on_test)
        prepare(small_source, out)

    assert snapshot(out) == before  # no temp files left behind, old files untouched
    assert pq.read_metadata(out / "train.parquet").num_rows == 256
    assert pq.read_metadata(out / "test.parquet").num_rows == 128
    assert json.loads((out / "manifest.json").read_text())["rows"] == {"train": 256, "test": 128}
    assert prepare(small_source, out).rows == {"train": 257, "test": 128}
