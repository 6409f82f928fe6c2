"""A verl user's training command line on CPU: verl's keys (notes, aliases), wandb offline, token-budget
log-prob passes and a custom reward file, end to end through `grpo train` (torchrun, gloo)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir
from tests.test_train import base_overrides, metrics

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """0.375 for every response of the capitals task: proves this file, its name and verl's arguments were used."""
    ok = data_source == "synthetic/capitals" and isinstance(solution_str, str) and isinstance(extra_info, dict)
    return {"score": 0.375 if ok else 0.0, "acc": ok}
'''


@pytest.fixture(scope="module")
def capitals(tmp_path_factory) -> Path:
    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    return capitals_data(tmp_path_factory.mktemp("capitals"))


def test_a_verl_command_line_trains_two_steps(tmp_path, capitals):
    model = tiny_model_dir(tmp_path / "model")
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD)
    run = tmp_path / "run"
    verl_keys = [
        "trainer.logger=[console,wandb]",
        "trainer.critic_warmup=0",
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=tiny_megatron",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.actor.megatron.use_mbridge=True",
        "data.return_raw_chat=True",
        "actor_rollout_ref.actor.optimizer.lr=1e-3",  # the guide's spelling
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=160",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=160",
        f"custom_reward_function.path={reward}",
        "custom_reward_function.name=compute_score",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb"),
    }
    (tmp_path / "wandb").mkdir()
    cmd = [sys.executable, "-m", "grpo_core.cli", "train", f"trainer.default_local_dir={run}"]
    cmd += [*base_overrides(model, capitals, 2), *verl_keys]
    cmd.remove("trainer.logger=[console]")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "note: trainer.critic_warmup: no effect here: GRPO has no critic" in result.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/mean"] == pytest.approx(0.375) for r in rows)  # the custom reward, called verl's way
    assert list((tmp_path / "wandb" / "wandb").glob("offline-run-*")), "no offline wandb run was written"
