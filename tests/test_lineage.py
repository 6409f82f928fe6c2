"""Data lineage: the digest every place names a dataset by, and the record `prepare` writes beside its files."""

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest

from grpo_core.data import gsm8k
from grpo_core.data.lineage import dataset_digest, read_record, record_of

EMBEDDED_DIR = Path(gsm8k.__file__).parent / "embedded"


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf_datasets_cache")


def test_the_digest_is_of_the_bytes_in_order_and_fits_mlflow(tmp_path):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    a.write_bytes(b"first"), b.write_bytes(b"second")
    digest = dataset_digest([a])
    sha = hashlib.sha256(b"first").hexdigest()
    assert digest == hashlib.sha256(f"{sha}\n".encode()).hexdigest()[:32]  # fixed: other tools may recompute it
    assert len(digest) <= 36 and digest == dataset_digest([str(a)])  # MLflow keeps 36 characters of a digest
    moved = tmp_path / "elsewhere" / "renamed.parquet"
    moved.parent.mkdir()
    shutil.copy(a, moved)
    assert dataset_digest([moved]) == digest  # the bytes count, not the name or place
    assert dataset_digest([a, b]) != dataset_digest([b, a]) != digest  # the order a trainer reads them in


def test_prepare_records_the_source_rows_and_each_files_digest(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        shutil.copy(EMBEDDED_DIR / f"gsm8k_{split}.jsonl", src / f"{split}.jsonl")
    out = tmp_path / "out"
    gsm8k.prepare_gsm8k(str(src), out, progress=False)

    record = read_record(out)
    assert (record["source"], record["source_kind"], record["revision"]) == (str(src), "local", None)
    assert record["source_files"] == {f"{s}.jsonl": hashlib.sha256((src / f"{s}.jsonl").read_bytes()).hexdigest()
                                      for s in ("train", "test")}  # fmt: skip
    assert (record["rows"], record["skipped"]) == ({"train": 256, "test": 128}, {"train": 0, "test": 0})
    assert record["digests"] == {f"{s}.parquet": dataset_digest([out / f"{s}.parquet"]) for s in ("train", "test")}

    train = record_of(out / "train.parquet")
    assert train["split"] == "train" and train["rows"] == 256 and train["digest"] == record["digests"]["train.parquet"]
    assert train["source_kind"] == "local" and train["data_source"] == "openai/gsm8k"
    (out / "test.parquet").write_bytes(b"changed since")
    assert record_of(out / "test.parquet") is None  # the record no longer describes it
    assert record_of(tmp_path / "src" / "train.jsonl") is None  # not a prepared file


def test_an_output_from_before_the_record_is_rebuilt(tmp_path):
    out = tmp_path / "out"
    gsm8k.prepare_gsm8k("embedded", out, progress=False)
    assert read_record(out)["source_kind"] == "embedded" and set(read_record(out)["source_files"]) == {
        "gsm8k_train.jsonl",
        "gsm8k_test.jsonl",
    }
    old = {k: v for k, v in read_record(out).items() if k not in ("digests", "source_kind")}
    (out / "manifest.json").write_text(json.dumps(old))
    assert not gsm8k.prepare_gsm8k("embedded", out, progress=False).reused
    assert "digests" in read_record(out)


def test_a_hub_source_records_its_commit_and_files(monkeypatch):
    lfs = SimpleNamespace(sha256="ab" * 32)
    siblings = [SimpleNamespace(rfilename="main/train-00000.parquet", lfs=lfs)]
    siblings += [SimpleNamespace(rfilename="socratic/train-00000.parquet", lfs=lfs)]
    siblings += [SimpleNamespace(rfilename="README.md", lfs=None)]
    info = SimpleNamespace(sha="c0ffee", siblings=siblings)

    class Api:
        def dataset_info(self, repo_id, files_metadata=False):
            assert repo_id == "openai/gsm8k" and files_metadata
            return info

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    files = {"main/train-00000.parquet": "ab" * 32}
    assert gsm8k._origin("openai/gsm8k", {}) == {"source_kind": "hub", "revision": "c0ffee", "source_files": files}

    class Offline:
        def dataset_info(self, repo_id, files_metadata=False):
            raise ConnectionError("offline")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    assert gsm8k._origin("openai/gsm8k", {}) == {"source_kind": "hub", "revision": None, "source_files": {}}
