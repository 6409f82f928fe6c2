"""Secrets in the config (config/secrets.py): which values are masked, and that config errors, the ranks'
command line, the launcher's logged command line and the MLflow pending file hold none. The end-to-end
check (a real pipeline, its run directory, MLflow store, terminal and rank) is in tests/test_pipeline.py."""

import json

import pytest

from grpo_core.config import ConfigError, load_config, to_flat_dict, to_yaml
from grpo_core.config.schema import iter_settings
from grpo_core.config.secrets import (
    env_by_reference,
    hide_url_passwords,
    is_secret,
    is_secret_name,
    masked,
    masked_command,
)
from grpo_core.config.verl_keys import concrete_keys
from tests.support.servers import free_port

PLANTED = {  # trainer.env's values, as issue 42 planted them
    "MY_PAT": "plantedpat123",
    "PRIVATE_KEY": "plantedkey456",
    "AUTH_HEADER": "Bearer plantedauth789",
    "DATABASE_URL": "postgresql://u:plantedpw@h/db",
    "HF_TOKEN": "hf_plantedtoken",
}
# What no file, terminal or command line may hold: the values' distinct parts ("planted" alone is a word of the
# tokenizer's vocabulary, so a checkpoint's tokenizer.json holds it)
LEAKS = ("plantedpat123", "plantedkey456", "plantedauth789", "plantedpw", "plantedtoken")


def env_overrides(planted: dict[str, str]) -> list[str]:
    return [f"+trainer.env.{name}={value}" for name, value in planted.items()]


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("accessToken", True),
        ("GITHUB_PAT", True),
        ("WANDB_API_KEY", True),
        ("apikey", True),
        ("PRIVATE_KEY", True),
        ("AUTH_HEADER", True),
        ("HTTP_AUTHORIZATION", True),
        ("DB_PASSWORD", True),
        ("client_secret", True),
        ("GOOGLE_APPLICATION_CREDENTIALS", True),
        ("prompt_key", False),
        ("max_token_len_per_gpu", False),
        ("max_new_tokens", False),
        ("tokenizer", False),
        ("author", False),
        ("PATH", False),
        ("PWD", False),  # the shell's working directory
        ("DATABASE_URL", False),  # its password is hidden in the value instead
        ("SLACK_WEBHOOK", True),
        ("notify_webhook_url", True),
    ],
)
def test_secret_names(name, secret):
    assert is_secret_name(name) is secret


def test_no_setting_of_this_tree_or_verl_reads_like_a_secret():
    """Else a plain setting (a token budget, a prompt key) would be masked in params and errors. The one secret
    by design: the notice's webhook URL (its path is often the token)."""
    keys = [key for key, _ in iter_settings()] + concrete_keys()
    secret = [key for key in keys if is_secret(key) and not key.startswith("trainer.env.")]
    assert secret == ["tracking.notify_webhook_url"]


def test_every_trainer_env_value_is_a_secret_whatever_its_name():
    assert is_secret("trainer.env.NCCL_DEBUG") and is_secret("trainer.env.ANYTHING")
    assert not is_secret("trainer.env") and not is_secret("trainer.nnodes")


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://u:plantedpw@h/db", "postgresql://u:***@h/db"),
        ("mysql+pymysql://root:p@ss@db:3306/x", "mysql+pymysql://root:***@db:3306/x"),  # an unescaped @
        ("uri=https://me:pw@host:5000/api and s3://bucket/a:b", "uri=https://me:***@host:5000/api and s3://bucket/a:b"),
        ("http://127.0.0.1:5000/#/experiments/1", "http://127.0.0.1:5000/#/experiments/1"),  # a port, no password
        ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
    ],
)
def test_url_passwords_are_hidden_under_any_key(text, shown):
    assert hide_url_passwords(text) == shown
    assert masked({"a": {"b": [text]}}) == {"a": {"b": [shown]}}


def test_masked_keeps_every_name_and_no_secret_in_nested_flat_and_flattened_trees():
    nested = {
        "trainer": {"env": {"NCCL_DEBUG": "WARN", "MY_PAT": "p"}, "nnodes": 2},
        "x": {"hf_token": "t", "tokens": 3, "creds": {"password": "pw", "user": "me"}},
    }
    assert masked(nested) == {
        "trainer": {"env": {"NCCL_DEBUG": "***", "MY_PAT": "***"}, "nnodes": 2},
        "x": {"hf_token": "***", "tokens": 3, "creds": {"password": "***", "user": "me"}},
    }
    flat = {"trainer.env": {"WANDB_API_KEY": "k"}, "trainer.env.X": "v", "x.hf_token": "t", "x.tokens": 3}
    assert masked(flat) == {"trainer.env": {"WANDB_API_KEY": "***"}, "trainer.env.X": "***", "x.hf_token": "***"} | {
        "x.tokens": 3
    }
    cfg = load_config(None, env_overrides(PLANTED))
    params = masked(to_flat_dict(cfg))
    assert params["trainer.env"] == dict.fromkeys([*load_config(None).trainer.env, *PLANTED], "***")
    assert not [v for v in PLANTED.values() if v in json.dumps(params) + to_yaml(cfg)]
    assert all(f"{name}: '***'" in to_yaml(cfg) for name in PLANTED)
    assert PLANTED["MY_PAT"] in to_yaml(cfg, mask_secrets=False)  # a config file that is to run keeps them


def test_the_ranks_get_names_on_their_command_line_and_values_from_their_environment(monkeypatch):
    from grpo_core.launch import JobShape, trainer_command

    overrides = [*env_overrides(PLANTED), "++trainer.env.NCCL_DEBUG=INFO", "trainer.total_training_steps=3"]
    launcher = load_config(None, overrides)
    command = trainer_command("/c.yaml", overrides, python="python")
    assert not [v for v in [*PLANTED.values(), "INFO"] if v in " ".join(command)]
    assert "+trainer.env.MY_PAT=${oc.env:MY_PAT}" in command and "trainer.total_training_steps=3" in command
    assert env_by_reference(["trainer.env={A: 1, B: x}", "trainer.env={}"]) == [
        "trainer.env.A=${oc.env:A}",
        "trainer.env.B=${oc.env:B}",
    ]
    for name, value in JobShape.from_config(launcher).env.items():  # what the launcher exports to every rank
        monkeypatch.setenv(name, value)
    rank = load_config(None, command[command.index("/c.yaml") + 1 :])
    assert rank == launcher  # the same config, so the same params from either
    mine = "+trainer.env.MY_PAT=${oc.env:MY_PAT}"  # the user's own reference: off the launcher's command line too
    assert env_by_reference([mine]) == [mine] and load_config(None, [mine]).trainer.env["MY_PAT"] == PLANTED["MY_PAT"]
    monkeypatch.delenv("MY_PAT")
    with pytest.raises(ConfigError, match="trainer.env.MY_PAT: .*'MY_PAT' not found"):
        load_config(None, command[command.index("/c.yaml") + 1 :])


WEBHOOK = "https://bot:plantedpw@hooks.example/services/plantedtoken"  # issue 53: a password, a token in its path


def test_every_secret_looking_override_reaches_the_ranks_and_a_slurm_job_by_environment_only(monkeypatch):
    """Issue 53: outside ``trainer.env`` too. The ranks' command line names a variable for a secret-named setting
    and for a URL with a password under an innocent key; the rank's config, read in the environment the launcher
    gives it, equals the launcher's; null stays null. The batch script checks the names and holds no value."""
    from grpo_core.launch import JobShape, trainer_command
    from grpo_core.launch.common import trainer_secrets
    from grpo_core.launch.slurm import sbatch_script

    mlflow = "http://u:plantedpw@127.0.0.1:5000"
    overrides = [
        f"tracking.notify_webhook_url={WEBHOOK}",
        f"tracking.mlflow_tracking_uri={mlflow}",
        "+trainer.env.MY_PAT=plantedpat123",
        "trainer.total_training_steps=3",
    ]
    launcher = load_config(None, overrides)
    command, secrets = trainer_command("/c.yaml", overrides, python="python"), trainer_secrets(overrides)
    assert not [leak for leak in LEAKS if leak in " ".join(command)]
    assert "tracking.notify_webhook_url=${oc.env:GRPO_TRACKING_NOTIFY_WEBHOOK_URL}" in command
    assert secrets["GRPO_TRACKING_NOTIFY_WEBHOOK_URL"] == WEBHOOK
    assert secrets["GRPO_TRACKING_MLFLOW_TRACKING_URI"] == mlflow
    for name, value in {**JobShape.from_config(launcher).env, **secrets}.items():
        monkeypatch.setenv(name, value)
    rank = load_config(None, command[command.index("/c.yaml") + 1 :])
    assert rank == launcher and rank.tracking.notify_webhook_url == WEBHOOK
    unset = ["tracking.notify_webhook_url=null"]
    assert trainer_command(None, unset, python="python")[3:] == unset and not trainer_secrets(unset)

    script = sbatch_script(command, JobShape.from_config(launcher), log_path="/r/slurm-%j.log", secret_env=secrets)
    assert not [leak for leak in LEAKS if leak in script]
    assert ': "${GRPO_TRACKING_NOTIFY_WEBHOOK_URL?not passed on by sbatch (a secret-looking override)}"' in script
    assert ': "${MY_PAT?not passed on by sbatch (trainer.env.MY_PAT)}"' in script


@pytest.mark.parametrize(
    "override",
    [
        "trainer.envv.MY_PAT=plantedpat123",  # an unknown key, named like a secret
        "+trainer.enf.SOME_VAR=plantedpat123",  # an unknown key, named like nothing in particular
        "+trainer.env.X={a:plantedpat123}",  # not a string
        "trainer.env.NEW_VAR=plantedpat123",  # not set yet: needs +
        "actor_rollout_ref.actor.optimizer.hf_token=plantedpat123",  # an alias of a section, then unknown
    ],
)
def test_config_errors_name_the_key_not_the_secret(override, capsys):
    from grpo_core.cli import main

    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert "plantedpat123" not in str(info.value) and override.split("=")[0].lstrip("+")[:12] in str(info.value)
    assert main(["train", "--dry-run", override]) == 2
    out, err = capsys.readouterr()
    assert "plantedpat123" not in out + err and "nothing was started" in err


def test_a_config_error_hides_a_url_password():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["tracking.mlflow_tracking_uri=postgresql://u:plantedpw@h/db", "trainer.nnodes=two"])
    assert "plantedpw" not in str(info.value)


def test_the_launcher_logs_its_command_line_without_secrets(tmp_path):
    import logging

    from grpo_core.launch.torchrun import NodeLogs, run_node

    argv = ["bash", "-c", "exit 0", "x", "+x.hf_token=plantedtok", "tracking.mlflow_tracking_uri=mysql://u:plantedpw@h"]
    assert masked_command(argv)[4:] == ["+x.hf_token=***", "tracking.mlflow_tracking_uri=mysql://u:***@h"]
    reference = "+trainer.env.MY_PAT=${oc.env:MY_PAT}"  # what a rank gets: shown, it says where the value comes from
    assert masked_command([reference, "trainer.env={A: plantedpat123}"]) == [reference, "trainer.env=***"]
    records: list[logging.LogRecord] = []  # every record, the run's-log-only ones too (no terminal filter here)
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("grpo_core.launch.torchrun")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(handler)
    try:
        run = run_node(argv, NodeLogs(tmp_path), timeout_s=30, poll_s=0.1)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    first = run.log_path.read_text().splitlines()[0]
    assert first.startswith("$ bash -c 'exit 0' x ") and "hf_token=***" in first and "planted" not in first
    said = "\n".join(r.getMessage() for r in records)
    assert "planted" not in said and "hf_token=***" in said and "starting bash on" in said


def test_the_pending_file_holds_names_not_values_and_sync_asks_for_a_hidden_password(tmp_path):
    from grpo_core.tracking.mlflow_run import MlflowRun
    from grpo_core.tracking.sync import SyncError, sync_pending

    uri = f"http://u:plantedpw@127.0.0.1:{free_port()}"  # nothing listens there
    run = MlflowRun(uri, "r1", pending_file=tmp_path / "mlflow_pending.jsonl", retry_s=60)
    run.log_params({"trainer.env": dict(PLANTED), "x.hf_token": "plantedtok", "data.seed": 4})
    assert not run.close(wait_s=0)
    text = (tmp_path / "mlflow_pending.jsonl").read_text()
    assert "MY_PAT" in text and "x.hf_token" in text and "data.seed" in text
    assert "planted" not in text
    with pytest.raises(SyncError, match="--tracking-uri"):
        sync_pending(tmp_path)
