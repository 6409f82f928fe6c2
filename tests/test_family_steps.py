"""Issue 43's "trains two steps on CPU": every policy loss, advantage estimator and rollout-correction mode of verl's
takes two real updates of a tiny Llama through the megatron actor (one torchrun launch, tests/dist/
family_steps_worker.py), configured from verl's keys as `grpo train` configures them. Each update has a finite loss
and a non-zero gradient, and two updates move the responses' log-probs with their advantages."""

import json
import math

import pytest

from tests.dist.launch import torchrun
from tests.test_actor import tiny_llama  # noqa: F401  (the module fixture: a 4-layer Llama, 64 wide)


@pytest.fixture(scope="module")
def family_steps(tiny_llama, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("family") / "steps.json"
    torchrun("family_steps_worker.py", 1, "--hf-dir", str(tiny_llama), "--out", str(out))
    return json.loads(out.read_text())


def _cases():
    from tests.dist.family_steps_worker import CASES

    return sorted(CASES)


def test_every_family_member_is_a_case():
    from grpo_core.algos import ADV_ESTIMATORS, POLICY_LOSSES

    names = _cases()
    assert {n.split("/")[1] for n in names if n.startswith("loss/")} == set(POLICY_LOSSES) - {"bypass_mode"}
    assert {n.split("/")[1] for n in names if n.startswith("estimator/")} == set(ADV_ESTIMATORS)
    assert any(n.startswith("correction/bypass") for n in names)  # bypass_mode's loss, as verl selects it


@pytest.mark.parametrize("case", _cases())
def test_two_updates_train_with_the_advantage(family_steps, case):
    result = family_steps[case]
    for step in result["steps"]:
        assert math.isfinite(step["actor/pg_loss"]) and step["actor/grad_norm"] > 0, step
    moved = [a - b for a, b in zip(result["after"], result["before"], strict=True)]
    assert max(abs(m) for m in moved) > 1e-4
    # the advantage-weighted change of the responses' mean log-prob is positive: the update follows the advantage
    assert sum(a * m for a, m in zip(result["advantage"], moved, strict=True)) > 0, (result["advantage"], moved)
    if case.startswith("correction/rs"):
        assert 0 < result["steps"][0]["rollout_corr/rollout_rs_masked_fraction"] < 1
