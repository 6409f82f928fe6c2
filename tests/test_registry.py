"""Models from the MLflow registry (`models:/NAME@ALIAS`, `models:/NAME/VERSION`) as a model path: parsed,
resolved against a real `mlflow server` on loopback, downloaded once per version; unusable URIs end in one line."""

import json
from pathlib import Path

import pytest

from grpo_core.cli import main
from grpo_core.tracking.registry import RegistryError, fetch_model, parse_model_uri, provenance_tags, version_dir
from tests.conftest import REPO
from tests.support.servers import free_port, mlflow_server
from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir

NAME = "tiny_registry"


def test_model_uris_parse():
    assert parse_model_uri("models:/grpo@champion") == ("grpo", "champion", None)
    assert parse_model_uri("models:/grpo-gsm8k/12") == ("grpo-gsm8k", None, "12")
    for bad in ("models:/", "models:/grpo", "models:/grpo/latest/x", "models:/a@b@c", "models:/grpo/v1"):
        with pytest.raises(RegistryError, match="models:/NAME@ALIAS or models:/NAME/VERSION"):
            parse_model_uri(bad)


def test_the_cache_is_keyed_by_the_version_and_its_server(tmp_path):
    a = version_dir(tmp_path, "http://a:5000", "grpo", "1", "mlflow-artifacts:/1/r/artifacts/model")
    assert a.parent == tmp_path / "grpo" and a.name.startswith("v1-")
    assert a != version_dir(tmp_path, "http://a:5000", "grpo", "2", "mlflow-artifacts:/1/s/artifacts/model")
    assert a != version_dir(tmp_path, "http://b:5000", "grpo", "1", "mlflow-artifacts:/1/r/artifacts/model")
    assert version_dir(tmp_path, "u", "a/b c", "1", "s").parent.name == "a_b_c"


def register(client, model_dir: Path, name: str, alias: str | None, tags: dict | None = None) -> str:
    """``model_dir`` logged as a run's ``model`` artifact and registered (as the pipeline does)."""
    experiment = client.get_experiment_by_name("registry_test") or client.get_experiment(
        client.create_experiment("registry_test")
    )
    run = client.create_run(experiment.experiment_id)
    client.log_artifacts(run.info.run_id, str(model_dir), "model")
    client.set_terminated(run.info.run_id)
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name)
    version = client.create_model_version(name, f"{run.info.artifact_uri}/model", run_id=run.info.run_id, tags=tags)
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return str(version.version)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A real mlflow server holding two versions of a tiny model; version 2 is the champion, registered with
    the digest of its files as the pipeline registers (version 1 from before digests)."""
    from mlflow import MlflowClient

    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    root = tmp_path_factory.mktemp("registry")
    with mlflow_server(root / "mlflow") as uri:
        client = MlflowClient(uri)
        register(client, tiny_model_dir(root / "v1", seed=1), NAME, None)
        v2 = tiny_model_dir(root / "v2", seed=2)
        register(client, v2, NAME, "champion", provenance_tags(v2, None))
        yield uri, root


def test_train_dry_run_resolves_an_alias_and_downloads_the_version_once(registry, tmp_path, capsys):
    uri, root = registry
    cache = tmp_path / "cache"
    args = [
        "train",
        "--dry-run",
        "--config",
        str(REPO / "configs/demo_cpu.yaml"),
        f"actor_rollout_ref.model.path=models:/{NAME}@champion",
        f"tracking.mlflow_tracking_uri={uri}",
        f"tracking.model_cache_dir={cache}",
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert f"note: actor_rollout_ref.model.path: models:/{NAME}@champion = models:/{NAME}/2" in captured.out
    (local,) = cache.glob(f"{NAME}/v2-*/model")
    assert (local / "model.safetensors").read_bytes() == (root / "v2" / "model.safetensors").read_bytes()
    stamp = (local / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 0  # resolved again, not downloaded again
    assert (local / "model.safetensors").stat().st_mtime_ns == stamp
    assert len(list(cache.glob(f"{NAME}/*"))) == 1


def test_a_copy_changed_after_registration_is_refused(registry, tmp_path, capsys):
    """The version's files are checked against the digest recorded on the tracking server at registration:
    a changed copy (in the artifact store, or here the local cache) is refused in one line, exit 2."""
    uri, _ = registry
    cache = tmp_path / "cache"
    model = fetch_model(f"models:/{NAME}@champion", uri, str(cache))  # downloaded and checked
    weights = model.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    args = ["train", "--dry-run", "--config", str(REPO / "configs/demo_cpu.yaml")]
    args += [f"actor_rollout_ref.model.path=models:/{NAME}@champion", f"tracking.mlflow_tracking_uri={uri}"]
    assert main([*args, f"tracking.model_cache_dir={cache}"]) == 2
    err = capsys.readouterr().err
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert f"models:/{NAME}@champion: the files of version 2 ({model.path}) are not those it was registered" in error
    assert "Traceback" not in err


def test_a_version_number_and_grpo_evaluate(registry, tmp_path, monkeypatch, capsys, caplog):
    uri, root = registry
    monkeypatch.setenv("GRPO_MODEL_CACHE", str(tmp_path / "cache"))
    data = capitals_data(tmp_path / "data", rows=8)
    args = ["evaluate", "--model", f"models:/{NAME}/1", "--tracking-uri", uri, "--data", str(data / "test.parquet")]
    args += ["--limit", "2", "--max-new-tokens", "4", "--output", str(tmp_path / "eval")]
    assert main(args) == 0
    assert f"models:/{NAME}/1 (local copy" in capsys.readouterr().err
    assert f"models:/{NAME}/1: version 1 records no grpo.model_sha256; its files are not checked" in caplog.text
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["num_questions"] == 2
    model = fetch_model(f"models:/{NAME}/1", uri, str(tmp_path / "cache"))
    assert model.version == "1" and (model.path / "config.json").is_file()


@pytest.mark.parametrize(
    "path,status,said",
    [
        (f"models:/{NAME}@nope", 2, f"registered model '{NAME}' has no alias 'nope'"),
        (f"models:/{NAME}/9", 2, f"registered model '{NAME}' has no version 9"),
        ("models:/no_such_model@champion", 2, "registered model 'no_such_model' has no alias 'champion'"),
        ("models:/broken", 2, "not a registry model URI"),
    ],
)
def test_a_missing_alias_or_version_is_one_line_exit_2(registry, tmp_path, capsys, path, status, said):
    uri, _ = registry
    args = ["train", "--dry-run", "--config", str(REPO / "configs/demo_cpu.yaml")]
    args += [f"actor_rollout_ref.model.path={path}", f"tracking.mlflow_tracking_uri={uri}"]
    args += [f"tracking.model_cache_dir={tmp_path}"]
    assert main(args) == status
    err = capsys.readouterr().err
    assert said in err and err.count("error:") == 1 and "Traceback" not in err


def test_a_server_that_is_down_is_one_line_exit_1(tmp_path, capsys):
    args = ["train", "--dry-run", "--config", str(REPO / "configs/demo_cpu.yaml")]
    args += [f"actor_rollout_ref.model.path=models:/{NAME}@champion"]
    args += [f"tracking.mlflow_tracking_uri=http://127.0.0.1:{free_port()}", f"tracking.model_cache_dir={tmp_path}"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("error:") == 1 and "MLflow at http://127.0.0.1:" in err
