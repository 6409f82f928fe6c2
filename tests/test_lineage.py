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


def test_prepare_records_the_source_rows_and_each_dataset_digest(tmp_path):
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


def test_datasets_and_the_logged_model_wait_for_the_server_and_a_replay_makes_them_once(tmp_path):
    """Queued while MLflow is down (plain JSON in the pending file), made by `grpo tracking sync`, and made once:
    the same calls sent again (a re-run of the pipeline records its results again) find what the first made."""
    from mlflow import MlflowClient

    from grpo_core.tracking.lineage import EVALUATION, TRAINING, dataset_entry
    from grpo_core.tracking.mlflow_run import MlflowRun
    from grpo_core.tracking.sync import read_records, sync_pending
    from tests.support.servers import free_port

    data, files = tmp_path / "data", tmp_path / "hf"
    gsm8k.prepare_gsm8k("embedded", data, progress=False)
    files.mkdir()
    (files / "config.json").write_text("{}")
    train = dataset_entry([str(data / "train.parquet")], TRAINING)
    test = dataset_entry([str(data / "test.parquet")], EVALUATION)
    pending = tmp_path / "run" / "mlflow_pending.jsonl"
    run = MlflowRun.deferred(f"http://127.0.0.1:{free_port()}", "lineage", "k1", {}, pending_file=pending, retry_s=60)
    run.log_datasets([train, test])
    link, tags = {"name": test["name"], "digest": test["digest"]}, {"grpo.step": "3"}
    model_id = run.log_checkpoint_model("step_000003", 3, tags, {"val/accuracy": 0.5}, dataset=link, files=str(files))
    version = run.register_model(
        "lineage_test", {"grpo.train_data_digest": train["digest"]}, "challenger", "step_000003"
    )
    assert (model_id, version) == (None, None)  # queued
    assert not run.close(wait_s=0)
    methods = [r["method"] for r in read_records(pending)]
    assert methods[-3:] == ["log_datasets", "log_checkpoint_model", "register_version"]

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert sync_pending(tmp_path / "run", tracking_uri=uri).complete
    client = MlflowClient(uri)
    (remote,) = client.search_runs([client.get_experiment_by_name("lineage").experiment_id])
    replay = MlflowRun(uri, remote.info.run_id)
    for record in read_records(pending)[-3:-1]:  # sent again: nothing new
        replay.call(record["method"], record["args"])

    remote = client.get_run(remote.info.run_id)
    assert sorted((i.dataset.name, i.dataset.digest) for i in remote.inputs.dataset_inputs) == [
        ("gsm8k-test", test["digest"]),
        ("gsm8k-train", train["digest"]),
    ]
    (model,) = client.search_logged_models([remote.info.experiment_id])
    assert [(o.model_id, o.step) for o in remote.outputs.model_outputs] == [(model.model_id, 3)]
    assert [(m.key, m.dataset_digest) for m in model.metrics][0] == ("val/accuracy", test["digest"])
    assert [a.path for a in client.list_logged_model_artifacts(model.model_id)] == ["config.json"]
    version = client.get_model_version_by_alias("lineage_test", "challenger")
    assert version.source == f"models:/{model.model_id}" and version.tags["grpo.train_data_digest"] == train["digest"]
    assert client.get_model_version_download_uri("lineage_test", version.version) == model.artifact_location
