"""`grpo plan`, `grpo prepare` and `grpo keys` through the command line entry point."""

import re

import pyarrow.parquet as pq
import pytest

from grpo_core.cli import main


def overrides_from_plan(out: str) -> list[str]:
    block = out.split("overrides:", 1)[1].split("estimated GiB", 1)[0]
    return [tok for tok in re.split(r"[\s\\]+", block) if "=" in tok]


@pytest.mark.parametrize(
    "model,gpus,layout",
    [
        ("Qwen/Qwen2-7B-Instruct", 8, "TP=2 PP=2"),
        ("Qwen/Qwen2.5-32B", 16, "TP=4 PP=4"),
        ("meta-llama/Llama-3.1-70B", 32, "TP=8 PP=4"),
    ],
)
def test_plan_reproduces_the_guide_matrix_and_its_overrides_pass_a_dry_run(model, gpus, layout, capsys):
    assert main(["plan", "--model", model, "--gpus", str(gpus), "--gpu-memory", "80", "--seq-len", "1536"]) == 0
    out = capsys.readouterr().out
    assert layout in out
    assert "fits in 50% of 80 GiB" in out  # the reason is stated with its numbers
    overrides = overrides_from_plan(out)
    nodes = max(gpus // 8, 1)
    args = [
        "train",
        "--dry-run",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.nnodes={nodes}",
        "trainer.n_gpus_per_node=8",
        "data.max_prompt_length=512",
        "data.max_response_length=1024",
        "data.train_batch_size=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        *overrides,
    ]
    assert main(args) == 0, capsys.readouterr().err


def test_plan_moe_uses_expert_parallelism(capsys):
    assert main(["plan", "--model", "Qwen/Qwen3-235B-A22B", "--gpus", "64", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "EP=8" in out and "expert_model_parallel_size=8" in out
    assert "num_layers_in_first_pipeline_stage" in out  # 94 layers over PP=8 need uneven stages


def test_plan_refuses_what_cannot_fit(capsys):
    assert main(["plan", "--model", "meta-llama/Llama-3.1-70B", "--gpus", "2", "--gpu-memory", "24"]) == 2
    assert "does not fit" in capsys.readouterr().err
    assert main(["plan", "--model", "./missing-model", "--gpus", "2", "--gpu-memory", "24"]) == 2
    assert "no such local directory" in capsys.readouterr().err


def test_prepare_full_gsm8k(shared_dir, tmp_path, capsys):
    out_dir = tmp_path / "gsm8k"
    assert main(["prepare", "--source", str(shared_dir / "data" / "gsm8k"), "--output", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "train: 7473 rows" in out and "test: 1319 rows" in out
    test = pq.read_table(out_dir / "test.parquet").to_pylist()
    assert test[0]["reward_model"] == {
        "style": "rule",
        "ground_truth": "18",
    }  # Janet's ducks: 16-3-4=9, 9*2=18
    assert main(["prepare", "--source", str(shared_dir / "data" / "gsm8k"), "--output", str(out_dir)]) == 0
    assert "unchanged input, kept" in capsys.readouterr().out


def test_prepare_bad_source_exits_2(tmp_path, capsys):
    assert main(["prepare", "--source", str(tmp_path / "nope"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err


def test_keys_lists_help(capsys):
    assert main(["keys", "actor_rollout_ref.actor.kl"]) == 0
    out = capsys.readouterr().out
    assert "kl_loss_coef" in out and "weight of the KL loss" in out


def test_unknown_arguments_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "x", "--gpus", "1", "--gpu-memory", "1", "stray"])
    assert e.value.code == 2


def test_notes_and_warnings_are_printed_once_not_again_by_each_rank(monkeypatch, capsys, tmp_path):
    """`grpo train` prints the config's notes before it starts the ranks; a rank it started (GRPO_LAUNCH_ID) does
    not repeat them, and of the ranks of a bare torchrun, rank 0 alone prints them."""
    from grpo_core import cli
    from tests.support.tiny import cpu_train_args

    monkeypatch.setattr("grpo_core.trainer.loop.train", lambda cfg, shape: {})
    monkeypatch.setattr("grpo_core.actor.parallel.shutdown_distributed", lambda: None)
    args = [
        "train",
        "actor_rollout_ref.actor.optim.weight_decay_incr_style=constant",  # a verl key with no effect: a note
        *cpu_train_args(tmp_path),
    ]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # this process is a rank
    printed = {}
    for rank, launched in (("0", True), ("0", False), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        if launched:
            monkeypatch.setenv("GRPO_LAUNCH_ID", "test")
        else:
            monkeypatch.delenv("GRPO_LAUNCH_ID", raising=False)
        assert cli.main(args) == 0
        printed[rank, launched] = "note: actor_rollout_ref.actor.optim.weight_decay" in capsys.readouterr().err
    assert printed == {("0", True): False, ("0", False): True, ("1", False): False}


def grpo_command(*args: str, cwd, env: dict | None = None, timeout: int = 120):
    """``grpo ARGS`` as a user runs it, in its own process (its own logging set-up, its own hub settings)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "grpo_core.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)


def test_version_answers_without_the_heavy_imports(tmp_path):
    from grpo_core.cli import package_version

    result = grpo_command("--version", cwd=tmp_path, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"grpo {package_version()}", result
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", package_version())  # installed (pip install -e .): pyproject's


def test_the_former_entry_point_path_hands_over_to_the_new_one(tmp_path):
    """`python -m grpo_core.trainer.main_ppo` (the path before the entry point moved above the trainer) still runs
    `grpo train`: here its help, through the process hand-over."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "grpo_core.trainer.main_ppo", "--help"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: grpo train"), result


def test_compare_outside_the_repo_says_so_and_creates_no_store(tmp_path):
    """Issue 44: `grpo compare` where there is no mlflow.db left an empty one behind; a read-only command writes
    nothing, and says where it looked."""
    result = grpo_command("compare", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": ""}, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: no MLflow store at sqlite:///mlflow.db (") and str(tmp_path) in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "path,missing",
    [
        ("models/does-not-exist", "models/does-not-exist"),  # models/ exists: a local path, the hub is not asked
        ("nosuchorg/nosuchmodel", "nosuchorg/nosuchmodel"),  # a hub id: asked once, it does not answer
    ],
)
def test_a_missing_model_path_is_one_line_in_seconds_with_the_hub_unreachable(path, missing, tmp_path):
    """Issue 44: 31-35 s of hub retries, 22 lines, then an error blaming the hub. Now: exit 2, at most 3 lines,
    within 15 s, and the line names the missing local directory first."""
    import time

    from tests.conftest import REPO
    from tests.support.servers import free_port

    (tmp_path / "models").mkdir()
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    start = time.monotonic()
    result = grpo_command(
        "pipeline",
        "--config",
        str(REPO / "configs/demo_cpu.yaml"),
        f"actor_rollout_ref.model.path={path}",
        cwd=tmp_path,
        env=env,
    )
    elapsed = time.monotonic() - start
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2 and len(lines) <= 3 and elapsed < 15, (elapsed, lines)
    assert lines[0].startswith(f"error: actor_rollout_ref.model.path: {missing}: no such local directory ("), lines
    assert str(tmp_path / missing) in lines[0] and "Traceback" not in result.stderr
