"""Models from the MLflow registry (`models:/NAME@ALIAS`, `models:/NAME/VERSION`) as a model path: parsed,
resolved against a real `mlflow server` on loopback, downloaded once per version; unusable URIs end in one line."""

import json
import shutil
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


def test_a_changed_copy_is_downloaded_again_and_a_changed_store_is_refused(registry, tmp_path, capsys, caplog):
    """The version's files are checked against the digest recorded on the tracking server at registration, before
    each use: a changed local copy is downloaded again, with one warning naming the file; a copy changed in the
    artifact store fails again after that download and is refused in one line, exit 2 (nothing of it kept)."""
    from mlflow import MlflowClient

    uri, root = registry
    cache = tmp_path / "cache"
    model = fetch_model(f"models:/{NAME}@champion", uri, str(cache))  # downloaded and checked
    weights = model.path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    caplog.clear()
    args = ["train", "--dry-run", "--config", str(REPO / "configs/demo_cpu.yaml")]
    args += [f"actor_rollout_ref.model.path=models:/{NAME}@champion", f"tracking.mlflow_tracking_uri={uri}"]
    assert main([*args, f"tracking.model_cache_dir={cache}"]) == 0
    [warning] = [r.getMessage() for r in caplog.records if "downloaded it again" in r.getMessage()]
    assert warning == (f"warning: models:/{NAME}@champion: the local copy {model.path} was not the files version 2 "
                       "was registered with (model.safetensors changed); downloaded it again")  # fmt: skip
    assert weights.read_bytes() == (root / "v2" / "model.safetensors").read_bytes()

    name = f"{NAME}_store"  # its own registered model: the other tests' versions stay as they are
    client = MlflowClient(uri)
    version = register(client, root / "v2", name, "champion", provenance_tags(root / "v2", None))
    run_id = client.get_model_version(name, version).run_id
    (stored,) = (root / "mlflow" / "art").glob(f"*/{run_id}/artifacts/model/model.safetensors")
    stored.write_bytes(bytes(data))  # changed in the artifact store
    evaluate = ["evaluate", "--model", f"models:/{name}@champion", "--tracking-uri", uri, "--data", str(tmp_path)]
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("GRPO_MODEL_CACHE", str(cache))
        assert main([*evaluate, "--output", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: models:/{name}@champion: the files of version 1 (mlflow-artifacts:/")
    assert error.endswith("and a fresh download is not either: changed in the artifact store; refused")
    assert "Traceback" not in err and not list(cache.glob(f"{name}/*/model")) and not (tmp_path / "eval").exists()


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


def write_adapter(model_dir: Path, out: Path, rank: int = 4, alpha: float = 8.0, seed: int = 0) -> Path:
    """A PEFT LoRA adapter of ``model_dir`` as `grpo export --peft` writes one: every linear adapted, one A shared by
    the modules a megatron linear fuses (q/k/v, gate/up), B random (a no-op adapter would prove nothing)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                    "num_key_value_heads"))  # fmt: skip
    head = hidden // heads
    g = torch.Generator().manual_seed(seed)
    outs = {"q_proj": heads * head, "k_proj": kv * head, "v_proj": kv * head, "o_proj": hidden}
    outs |= {"gate_proj": inter, "up_proj": inter, "down_proj": hidden}
    ins = {name: inter if name == "down_proj" else hidden for name in outs}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        shared = {group: torch.randn(rank, hidden, generator=g) for group in ("qkv", "gate_up")}
        for name, rows in outs.items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            group = "qkv" if name in ("q_proj", "k_proj", "v_proj") else "gate_up" if name != "down_proj" else None
            a = shared[group] if group and name != "o_proj" else torch.randn(rank, ins[name], generator=g)
            tensors[f"{key}.lora_A.weight"] = a.clone()
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.1
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                      "base_model_name_or_path": str(model_dir), "target_modules": sorted(outs), "lora_dropout": 0.0,
                      "bias": "none", "fan_in_fan_out": False, "inference_mode": True}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out


@pytest.fixture(scope="module")
def adapter_version(registry):
    """Version 3: a LoRA adapter whose base is version 2 (``models:/NAME/2``), as a LoRA pipeline run registers it."""
    from mlflow import MlflowClient

    from grpo_core.tracking.registry import ADAPTER_BASE_TAG

    uri, root = registry
    adapter = write_adapter(root / "v2", root / "v3")
    tags = {**provenance_tags(adapter, None), ADAPTER_BASE_TAG: f"models:/{NAME}/2"}
    version = register(MlflowClient(uri), adapter, NAME, "lora", tags)
    return uri, root, version


def test_an_adapter_version_starts_a_lora_run_from_its_base_and_is_evaluated_merged(
    adapter_version, tmp_path, capsys, caplog
):
    """`models:/NAME@lora` (an adapter on version 2): a LoRA run resolves to version 2's weights with the adapters
    starting from the adapter (pinned for the ranks, its base named for the next registration); a run without LoRA
    is one line, exit 2; `grpo evaluate` evaluates the base with the adapter merged, which is peft's merge; a merged
    copy changed afterwards is merged again before the next evaluation."""
    pytest.importorskip("peft")
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo_core.checks.dry_run import resolve_run

    uri, root, version = adapter_version
    cache = tmp_path / "cache"
    common = [f"actor_rollout_ref.model.path=models:/{NAME}@lora", f"tracking.mlflow_tracking_uri={uri}"]
    common += [f"tracking.model_cache_dir={cache}"]
    config = str(REPO / "configs/demo_cpu.yaml")
    assert main(["train", "--dry-run", "--config", config, *common]) == 2
    err = capsys.readouterr().err
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert f"models:/{NAME}/{version} is a LoRA adapter; a run from it trains the adapter: set" in error
    lora = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8"]
    assert main(["train", "--dry-run", "--config", config, *common, *lora]) == 0
    assert f"a LoRA adapter on models:/{NAME}/2" in capsys.readouterr().out
    run = resolve_run(config, [*common, *lora])
    (base,) = cache.glob(f"{NAME}/v2-*/model")
    (adapter,) = cache.glob(f"{NAME}/v{version}-*/model")
    assert run.lora_base == f"models:/{NAME}/2" and run.start_model.is_adapter
    pinned = run.pinned(common)[len(common) :]
    assert pinned == [f"actor_rollout_ref.model.path={base}", f"actor_rollout_ref.model.lora.adapter_path={adapter}"]
    other = ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=8"]
    assert main(["train", "--dry-run", "--config", config, *common, *other]) == 2
    assert "has rank 4 and alpha 8, the run rank 8 and alpha 8" in capsys.readouterr().err

    data = capitals_data(tmp_path / "data", rows=8)
    args = ["evaluate", "--model", f"models:/{NAME}@lora", "--tracking-uri", uri, "--data", str(data / "test.parquet")]
    args += ["--limit", "2", "--max-new-tokens", "4", "--output", str(tmp_path / "eval")]
    env_cache = pytest.MonkeyPatch.context()
    with env_cache as m:
        m.setenv("GRPO_MODEL_CACHE", str(cache))
        assert main(args) == 0
    merged = load_file(str(adapter.parent / "merged" / "model.safetensors"))
    with torch.no_grad():
        expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()
    expected = expected.state_dict()
    assert set(merged) <= set(expected) and "model.layers.0.self_attn.q_proj.weight" in merged
    for key, value in merged.items():
        assert torch.allclose(value, expected[key], atol=1e-6), key
    q = "model.layers.1.mlp.gate_proj.weight"
    assert not torch.allclose(merged[q], load_file(str(base / "model.safetensors"))[q], atol=1e-3)  # it acts

    # the merged copy is checked before each use: another model's weights of the same shape put there are merged
    # again from the checked adapter and base, with one warning, and never evaluated
    merged_file = adapter.parent / "merged" / "model.safetensors"
    written = merged_file.read_bytes()
    shutil.copy(root / "v1" / "model.safetensors", merged_file)
    caplog.clear()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("GRPO_MODEL_CACHE", str(cache))
        assert main([*args[:-1], str(tmp_path / "again")]) == 0
    [warning] = [r.getMessage() for r in caplog.records if "merged model" in r.getMessage()]
    assert warning == (f"warning: models:/{NAME}@lora: its merged model is not what the merge wrote: {merged_file}: "
                       "content differs from the manifest (hash mismatch); merging it again from the checked adapter "
                       "and base")  # fmt: skip
    assert merged_file.read_bytes() == written
    samples = [(tmp_path / out / "samples.jsonl").read_text() for out in ("eval", "again")]
    assert samples[0] == samples[1]  # what the first evaluation answered, from the same weights


def test_an_adapter_of_other_shapes_and_tags_that_do_not_parse_are_one_line(registry, tmp_path, capsys):
    """Issue 53: a registered adapter of another model's shapes is refused in one line, exit 2, before anything is
    merged or started: by `grpo evaluate` (whose merge raised a RuntimeError) and by a LoRA dry run from it (whose
    ranks failed); a version whose tags the project reads do not parse (records/tags.py) is refused when fetched."""
    from mlflow import MlflowClient

    from grpo_core.tracking.registry import ADAPTER_BASE_TAG

    uri, root = registry
    name, client, cache = f"{NAME}_records", MlflowClient(uri), tmp_path / "cache"
    base = register(client, root / "v2", name, None, provenance_tags(root / "v2", None))
    other = write_adapter(tiny_model_dir(tmp_path / "narrower", hidden=32), tmp_path / "adapter")
    tags = {**provenance_tags(other, None), ADAPTER_BASE_TAG: f"models:/{name}/{base}"}
    wrong = register(client, other, name, None, tags)
    odd = register(client, root / "v2", name, None, {"grpo.model_sha256": "not a digest"})
    data = capitals_data(tmp_path / "data", rows=8)
    evaluate = ["evaluate", "--tracking-uri", uri, "--data", str(data / "test.parquet")]
    evaluate += ["--output", str(tmp_path / "eval")]

    def one_line(argv: list[str]) -> str:
        with pytest.MonkeyPatch.context() as m:
            m.setenv("GRPO_MODEL_CACHE", str(cache))
            assert main(argv) == 2
        err = capsys.readouterr().err
        [error] = [line for line in err.splitlines() if line.startswith("error:")]
        assert "Traceback" not in err
        return error

    error = one_line([*evaluate, "--model", f"models:/{name}/{wrong}"])
    (adapter,) = cache.glob(f"{name}/v{wrong}-*/model")
    (base_copy,) = cache.glob(f"{name}/v{base}-*/model")
    assert error.startswith(f"error: {adapter / 'adapter_model.safetensors'}: module model.layers.0."), error
    assert f"update; the base {base_copy} has [" in error, error
    assert not list(adapter.parent.glob("merged*")) and not (tmp_path / "eval").exists()

    lora = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8"]
    dry = ["train", "--dry-run", "--config", str(REPO / "configs/demo_cpu.yaml"), f"tracking.mlflow_tracking_uri={uri}"]
    dry += [f"tracking.model_cache_dir={cache}", *lora, f"actor_rollout_ref.model.path=models:/{name}/{wrong}"]
    said = f"error: actor_rollout_ref.model.lora.adapter_path: {adapter / 'adapter_model.safetensors'}: module model."
    assert one_line(dry).startswith(said)
    assert one_line([*evaluate, "--model", f"models:/{name}/{odd}"]) == (
        f"error: models:/{name}/{odd} (version {odd}): tag 'grpo.model_sha256': expected 64 lowercase hex digits, got "
        "'not a digest'"
    )
