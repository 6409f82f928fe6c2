"""New data, exactly once (issue 38): the order the sampler draws rows in when the training set grows, the rows a
run has seen, the data a checkpoint's position counts in, and which inputs of a scheduled run changed. Pure
functions on CPU; the pipeline's side is in tests/test_deployment.py's nightly run."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from grpo_core.checkpoint.manager import STATE_FILE, CheckpointError, check_same_data
from grpo_core.data.lineage import dataset_digest
from grpo_core.data.prompts import Prompt, PromptSampler, row_id, seen_digest


def prompts(first: int, count: int) -> list[Prompt]:
    """Rows ``first`` .. ``first + count - 1`` of a training set, as load_prompts makes them."""
    rows = []
    for i in range(first, first + count):
        messages = [{"role": "user", "content": f"What is {i} + {i}?"}]
        rows.append(Prompt([i], "synthetic", str(2 * i), i, row_id=row_id(messages, str(2 * i))))
    return rows


def epoch_ids(sampler: PromptSampler, epoch: int) -> list[str]:
    """The row ids an epoch draws, in order (its complete batches)."""
    steps = range(epoch * sampler.steps_per_epoch, (epoch + 1) * sampler.steps_per_epoch)
    return [p.row_id for step in steps for p in sampler.batch(step)]


def test_appended_rows_come_first_and_each_is_drawn_once_in_every_epoch():
    """13 rows trained on, 5 appended, batches of 4: 4 batches an epoch, 2 rows left out of each. Every epoch
    draws the 5 new rows first, each once, in that epoch's seeded order; the left-out tail is seen rows."""
    old, new = prompts(0, 13), prompts(13, 5)
    seen = {p.row_id for p in old}
    sampler = PromptSampler(old + new, batch_size=4, seed=7, seen=seen)
    assert (sampler.steps_per_epoch, sampler.new_rows) == (4, 5)
    new_ids = [p.row_id for p in new]
    for epoch in range(3):
        drawn = epoch_ids(sampler, epoch)
        assert sorted(drawn[:5]) == sorted(new_ids)  # first: the 5 new rows, once each
        assert all(drawn.count(i) == 1 for i in new_ids) and len(set(drawn)) == len(drawn) == 16
        # defined: the epoch's permutation (seed + epoch), new rows first, each part in its permuted order
        order = torch.randperm(18, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        rows = old + new
        expected = [rows[i].row_id for i in order if i >= 13] + [rows[i].row_id for i in order if i < 13]
        assert drawn == expected[:16]
    # seeded: the same seed draws the same; another seed another order of the same new rows first
    assert epoch_ids(PromptSampler(old + new, 4, seed=7, seen=seen), 1) == epoch_ids(sampler, 1)
    other = epoch_ids(PromptSampler(old + new, 4, seed=8, seen=seen), 0)
    assert other != epoch_ids(sampler, 0) and sorted(other[:5]) == sorted(new_ids)


def test_with_nothing_seen_or_nothing_new_the_order_is_the_seeded_permutation():
    """A run whose start model records no rows (every run before issue 38) draws exactly what it drew before, so
    its checkpoints resume as they did; a run with no new row draws the same too."""
    rows = prompts(0, 10)
    for seen in (set(), {p.row_id for p in rows}):
        sampler = PromptSampler(rows, batch_size=3, seed=1, seen=seen)
        for epoch in range(2):
            order = torch.randperm(10, generator=torch.Generator().manual_seed(1 + epoch)).tolist()
            assert epoch_ids(sampler, epoch) == [rows[i].row_id for i in order[:9]]
    unshuffled = PromptSampler(prompts(0, 4) + prompts(4, 2), 2, shuffle=False, seen={p.row_id for p in rows[:4]})
    assert [p.index for step in range(3) for p in unshuffled.batch(step)] == [4, 5, 0, 1, 2, 3]


def test_drawn_is_the_rows_of_the_batches_before_a_data_position():
    rows = prompts(0, 10)
    sampler = PromptSampler(rows, batch_size=3, seed=3, seen={rows[0].row_id})
    for position in range(8):
        expected = {p.row_id for step in range(position) for p in sampler.batch(step)}
        assert sampler.drawn(position) == expected, position
    # 3 batches of 3 an epoch: the one row left out of every epoch is the seen one, last in each order
    assert sampler.drawn(3) == sampler.drawn(30) == {p.row_id for p in rows[1:]}


def test_a_rows_identity_is_its_messages_and_answer_not_its_place():
    messages = [{"content": "What is 2 + 2?", "role": "user"}]
    assert row_id(messages, "4") == row_id([{"role": "user", "content": "What is 2 + 2?"}], 4)
    assert row_id(messages, "4") != row_id(messages, "5")
    assert len(row_id(messages, "4")) == 16


def table(rows: int) -> pa.Table:
    return pa.Table.from_pylist([{"q": f"question {i}"} for i in range(rows)])


def test_a_data_position_in_another_training_set_is_refused_in_one_line(tmp_path):
    """check_same_data: what `grpo train` and every rank check before resuming (the CLI's refusal, exit 2, is
    tests/test_checkpoint.py::test_train_refuses_to_resume_a_data_position_in_another_training_set)."""
    checkpoint = tmp_path / "step_000003"
    checkpoint.mkdir()
    saved = {"train_digest": "a" * 64, "rows": 13, "seen_sha256": seen_digest(frozenset())}
    state = {"step": 3, "data_position": 3, "data": saved}
    (checkpoint / STATE_FILE).write_text(json.dumps(state))
    check_same_data(checkpoint, saved)  # the same training set: resumed exactly
    with pytest.raises(CheckpointError) as refused:
        check_same_data(checkpoint, {**saved, "train_digest": "b" * 64, "rows": 18})
    message = str(refused.value)
    assert message.startswith(
        f"{checkpoint / STATE_FILE}: its data position (3 batches) counts in another training set (digest "
        f"{'a' * 12} there, {'b' * 12} here), so resuming would skip or repeat rows; train afresh "
        "(trainer.resume_mode=disable or a new trainer.default_local_dir)"
    )
    assert "\n" not in message and f"grpo export {checkpoint} DIR" in message
    with pytest.raises(CheckpointError, match="another set of rows seen before the run"):
        check_same_data(checkpoint, {**saved, "seen_sha256": seen_digest(frozenset({"0123456789abcdef"}))})
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": 3, "data_position": 3}))
    check_same_data(checkpoint, {**saved, "train_digest": "b" * 64})  # saved before issue 38: taken as it is


def test_a_scheduled_run_says_which_of_its_inputs_changed():
    from grpo_core.pipeline.inputs import inputs_verdict

    now = {
        "grpo.inputs.data_digest": "d" * 64,
        "grpo.inputs.config": "0123456789abcdef",
        "grpo.inputs.start_model": "models:/m/2",
    }
    assert inputs_verdict(None, now) == (False, "training: there is no finished scheduled run to compare with")
    same = inputs_verdict(("r1", {**now, "other": "x"}), now)
    assert same == (
        True,
        f"nothing to train: the training data (digest {'d' * 12}), the resolved config (0123456789abcdef) and the "
        "start model (models:/m/2) are those of the last scheduled run (MLflow run r1)",
    )
    grown = inputs_verdict(("r1", {**now, "grpo.inputs.data_digest": "c" * 64}), now)
    assert grown == (
        False,
        f"training: since the last scheduled run (MLflow run r1), the training data changed (digest {'c' * 12} -> "
        f"digest {'d' * 12}); the resolved config and the start model did not",
    )
    promoted = inputs_verdict(("r1", {**now, "grpo.inputs.start_model": "models:/m/1", "grpo.inputs.config": "f"}), now)
    assert promoted[1] == (
        "training: since the last scheduled run (MLflow run r1), the resolved config changed (f -> 0123456789abcdef) "
        "and the start model changed (models:/m/1 -> models:/m/2); the training data did not"
    )
    before = inputs_verdict(("r0", {"grpo.inputs_key": "x"}), now)  # a run from before the inputs were recorded
    assert not before[0] and "the training data changed (not recorded -> digest " in before[1]


def test_the_pipelines_train_task_refuses_a_checkpoint_of_another_training_set_before_any_rank_starts(tmp_path):
    """The pipeline's train task resumes its run directory's newest checkpoint (resume_mode=auto): on a training set
    that changed since, it stops at once with the same line (a CheckpointError, which is not retried)."""
    from prefect.logging import disable_run_logger

    from tasks.retry import PERMANENT
    from tasks.train import train_grpo
    from tests.conftest import REPO

    train = tmp_path / "train.parquet"
    pq.write_table(table(6), train)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    saved = {"train_digest": "a" * 64, "rows": 5, "seen_sha256": seen_digest(frozenset())}
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": 2, "data_position": 2, "data": saved}))
    overrides = [f"data.train_files=[{train}]", f"trainer.default_local_dir={tmp_path / 'run'}"]
    with disable_run_logger(), pytest.raises(CheckpointError, match="counts in another training set") as refused:
        train_grpo.fn(str(REPO / "configs/demo_cpu.yaml"), overrides, "run-id")
    assert isinstance(refused.value, PERMANENT) and not (tmp_path / "run" / "launch").exists()
    assert f"(digest {'a' * 12} there, {dataset_digest([train])[:12]} here)" in str(refused.value)
