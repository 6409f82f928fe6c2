"""Loading configs: schema defaults and docs, YAML + overrides, aliases, unknown keys, file/line errors."""

import pytest

from grpo_core.config import ALIASES, ConfigError, load_config, to_flat_dict
from grpo_core.config.schema import iter_settings
from tests.conftest import REPO


def problems_of(path=None, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return e.value.problems


def test_every_setting_has_a_default_and_help():
    settings = dict(iter_settings())
    assert len(settings) > 100
    for key, f in settings.items():
        assert f.metadata.get("help"), f"{key} has no help text"
    cfg = load_config(None)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.model.trust_remote_code is False
    assert cfg.trainer.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_overrides_are_typed_by_the_schema():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "data.train_files=one.parquet",
            "trainer.logger=[console,mlflow]",
            "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
            "+trainer.env.NCCL_IB_DISABLE=1",
        ],
    )
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False
    assert cfg.data.train_files == ["one.parquet"]
    assert cfg.trainer.logger == ["console", "mlflow"]
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config == {"recompute_granularity": "full"}
    assert cfg.trainer.env["NCCL_IB_DISABLE"] == "1"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  nnodes: 2\n  n_gpus_per_node: 4\nalgorithm:\n  group_size: 6\n")
    cfg = load_config(path, ["trainer.nnodes=3"])
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (3, 4)
    assert cfg.actor_rollout_ref.rollout.n == 6  # the guide's alias landed on verl's key
    # The command line wins over the file even when it uses the other spelling.
    assert load_config(path, ["actor_rollout_ref.rollout.n=8"]).actor_rollout_ref.rollout.n == 8


@pytest.mark.parametrize("alias,canonical", sorted(ALIASES.items()))
def test_aliases_agree_or_conflict(alias, canonical):
    listed = canonical.endswith("_modules")  # LoRA's module lists: one name stands for a list of it
    value, other, expected = ("linear_qkv", "linear_fc2", ["linear_qkv"]) if listed else (7, 9, 7)
    if canonical.endswith("_path"):  # a directory
        value, other, expected = "/a", "/b", "/a"
    cfg = load_config(None, [f"{alias}={value}"])
    node = cfg
    for part in canonical.split("."):
        node = getattr(node, part)
    assert node == expected
    assert load_config(None, [f"{alias}={value}", f"{canonical}={value}"])  # both, same value: fine
    (problem,) = problems_of(overrides=[f"{alias}={value}", f"{canonical}={other}"])
    assert alias in problem and canonical in problem and "conflicts" in problem


def test_unknown_keys_point_at_the_line_and_suggest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_batch_size: 8\nactor_rollout_ref:\n  actor:\n    ppo_epoch: 2\n")
    (problem,) = problems_of(path)
    assert problem.startswith(f"{path}:5:")
    assert "did you mean 'actor_rollout_ref.actor.ppo_epochs'" in problem


def test_every_problem_is_reported_at_once():
    problems = problems_of(overrides=["trainer.nnodes=two", "trainer.n_gpu_per_node=4", "bogus"])
    assert len(problems) == 3
    assert any("trainer.nnodes='two' is not a valid int" in p for p in problems)
    assert any("did you mean 'trainer.n_gpus_per_node'" in p for p in problems)
    assert any("expected key=value" in p for p in problems)


def test_adding_a_free_form_key_needs_plus():
    (problem,) = problems_of(overrides=["trainer.env.NEW_VAR=1"])
    assert "+trainer.env.NEW_VAR" in problem


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  train_batch_size: [1, 2\ntrainer: {}\n")
    (problem,) = problems_of(bad)
    assert problem.startswith(f"{bad}:") and "malformed YAML" in problem
    (problem,) = problems_of(tmp_path / "missing.yaml")
    assert "config file not found" in problem
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    assert "must be a mapping" in problems_of(listy)[0]


def test_a_config_file_that_is_not_utf8_is_one_line_naming_its_line(tmp_path, capsys):
    """A file saved as Latin-1: the file, the line and the byte, exit 2; not a UnicodeDecodeError traceback."""
    from grpo_core.cli import main

    latin1 = tmp_path / "bad.yaml"
    latin1.write_bytes("data:\n  train_batch_size: 8\ntrainer:\n  project_name: café\n".encode("latin-1"))
    (problem,) = problems_of(latin1)
    assert problem == f"{latin1}:4: not UTF-8 text (byte 0xe9 at offset 56); save it as UTF-8"
    assert main(["train", "--config", str(latin1), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"error: {problem}" in err.splitlines() and "Traceback" not in err


def test_shipped_configs_load_and_flatten():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        flat = to_flat_dict(load_config(path))
        assert flat["algorithm.adv_estimator"] == "grpo", path
        assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size" in flat


@pytest.mark.parametrize("bf16_cpu", [True, False], ids=["bf16 CPU", "AVX2 CPU"])
def test_auto_dtype_is_bf16_where_the_hardware_multiplies_in_it_and_bf16_elsewhere_is_warned_about(
    monkeypatch, bf16_cpu
):
    from grpo_core.checks.validate import check_config
    from grpo_core.config import hardware

    monkeypatch.setattr(hardware, "cpu_has_bf16_matmul", lambda: bf16_cpu)
    demo = REPO / "configs/demo_cpu.yaml"  # dtype: auto for the actor, the rollout and the evaluation
    cfg = load_config(demo)
    arr, want = cfg.actor_rollout_ref, "bfloat16" if bf16_cpu else "float32"
    assert (arr.actor.megatron.dtype, arr.rollout.dtype, cfg.evaluation.dtype) == (want, want, want)
    assert load_config(demo, ["trainer.device=cuda"]).actor_rollout_ref.rollout.dtype == "bfloat16"
    assert not [w for w in check_config(cfg, None).warnings if "bfloat16" in w]
    explicit = load_config(demo, ["actor_rollout_ref.actor.megatron.dtype=bfloat16"])
    warned = [w for w in check_config(explicit, None).warnings if "bf16 matrix instructions" in w]
    assert [w.split("=")[0] for w in warned] == ([] if bf16_cpu else ["actor_rollout_ref.actor.megatron.dtype"])


def test_a_lower_upper_threshold_is_not_read_as_a_number_with_a_digit_separator(tmp_path):
    """YAML 1.1 and OmegaConf read ``0.5_2`` as 0.52; verl means the window [0.5, 2]."""
    from grpo_core.algos import parse_is_threshold, parse_rs

    rc = "algorithm.rollout_correction."
    (tmp_path / "c.yaml").write_text(
        "algorithm:\n  rollout_correction:\n    rollout_is: token\n    rollout_is_threshold: 0.5_2\n"
        "    rollout_rs: token_k1\n    rollout_rs_threshold: 0.5_2\n"
    )
    overrides = [f"{rc}rollout_is=token", f"{rc}rollout_is_threshold=0.5_2"]
    overrides += [f"{rc}rollout_rs=token_k1", f"{rc}rollout_rs_threshold=0.5_2"]
    for cfg in (load_config(tmp_path / "c.yaml"), load_config(None, overrides)):
        c = cfg.algorithm.rollout_correction
        assert parse_is_threshold(c.rollout_is_threshold) == (2.0, 0.5)
        assert parse_rs(c.rollout_rs, c.rollout_rs_threshold) == {"token_k1": (0.5, 2.0)}
    # a plain number stays a number; other keys keep YAML's reading
    assert load_config(None, [f"{rc}rollout_is_threshold=2.5"]).algorithm.rollout_correction.rollout_is_threshold == 2.5
    assert load_config(None, ["trainer.total_training_steps=1_000"]).trainer.total_training_steps == 1000


def test_the_dapo_recipes_overlong_buffer_spelling_counts_back_from_the_response_length(tmp_path):
    """verl's recipe/dapo (main_dapo) writes reward_model.overlong_buffer.* and builds its reward manager with
    max_resp_len=data.max_response_length; an explicit max_resp_len, in a file or an override, still wins."""
    recipe = ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4"]
    kwargs = load_config(None, [*recipe, "data.max_response_length=16"]).reward_model.reward_kwargs
    assert (kwargs.overlong_buffer_cfg.enable, kwargs.overlong_buffer_cfg.len, kwargs.max_resp_len) == (True, 4, 16)
    (tmp_path / "c.yaml").write_text("reward_model:\n  reward_kwargs:\n    max_resp_len: 12\n")
    assert (
        load_config(
            tmp_path / "c.yaml", [*recipe, "data.max_response_length=16"]
        ).reward_model.reward_kwargs.max_resp_len
        == 12
    )
    assert load_config(None, ["data.max_response_length=16"]).reward_model.reward_kwargs.max_resp_len is None
