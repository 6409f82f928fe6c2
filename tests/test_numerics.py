"""Finite or stopped: a reward, loss or gradient that is not a number stops the run in one line before the
update, and no checkpoint is written with weights that are not numbers (NaN/inf settings: test_dry_run)."""

import pytest

from grpo_core.checkpoint.manager import CheckpointManager
from grpo_core.numerics import NotFinite, first_non_finite
from tests.support.tiny import tiny_model_dir
from tests.test_train import base_overrides, capitals, grpo_train  # noqa: F401  (fixture)

REWARDS = {  # a reward file's body; the error line it must end in
    "nan reward": (
        "return float('nan')",
        "; a reward must be a finite number. The run stopped before the update: nothing of this step was trained",
    ),
    # finite rewards whose differences overflow float32 in the loss (no division by the group's std)
    "loss overflows": (  # alternating: each group's rewards differ, whatever was sampled
        "CALLS.append(1)\n    return 3e38 if len(CALLS) % 2 else -3e38",
        "optimizer step 1: the loss or its gradients hold NaN or infinity",
    ),
}


@pytest.mark.parametrize("case", REWARDS)
def test_a_reward_or_loss_that_is_not_a_number_stops_the_run_before_the_update(case, tmp_path, capitals):  # noqa: F811
    body, says = REWARDS[case]
    reward = tmp_path / "reward.py"
    signature = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
    reward.write_text(f"CALLS = []\n{signature}\n    {body}\n")
    run = tmp_path / "run"
    model = tiny_model_dir(tmp_path / "model")
    proc = grpo_train(
        run,
        *base_overrides(model, capitals, 2),
        f"custom_reward_function.path={reward}",
        "algorithm.norm_adv_by_std_in_grpo=false",
        "trainer.save_freq=1",
        "actor_rollout_ref.rollout.temperature=1.0",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # the launcher's, naming
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]  # the rank and what it said
    if case == "nan reward":
        assert f"custom_reward_function {reward}:compute_score returned nan for response " in errors[0]
    assert "Traceback" not in proc.stderr
    assert not list(run.glob("checkpoints/step_*"))  # nothing saved, not even step 1's


class _DivergedActor:
    """What CheckpointManager.save asks of an actor before it writes: whose weights are not numbers."""

    def non_finite_weights(self):
        return ["decoder.layers.0.mlp.linear_fc1.weight"], True


def test_no_checkpoint_is_written_with_weights_that_are_not_numbers(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    with pytest.raises(NotFinite, match=r"not saving step 3: weights hold NaN or infinity \(decoder.layers.0.mlp"):
        manager.save(3, _DivergedActor(), {})
    assert not (tmp_path / "checkpoints").exists()


def test_first_non_finite():
    assert first_non_finite([0.0, 1.0, -2.5]) is None
    index, value = first_non_finite([0.0, float("inf"), float("nan")])
    assert index == 1 and value == float("inf")
