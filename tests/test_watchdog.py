"""Issue 38, item 6: hangs fail loudly. The watchdog's parts (the ranks' phase records, the launcher's judgement,
the stack dump and the kill), then a real hang: rank 1 of a 2-rank `grpo train` blocked in its reward, rank 0
waiting for it in a gloo collective, ended within the limit and retried by the pipeline's train task, which
finishes the run with the metrics of an uninterrupted one."""

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_core.diagnostics.watchdog import (
    FIRST_STEP_S,
    FLOOR_S,
    STEP_MULTIPLE,
    PhaseRecord,
    PhaseRecorder,
    find_hang,
    phase_limit,
    ranks,
    read_records,
)
from grpo_core.launch import LaunchError
from grpo_core.launch.torchrun import NodeLogs, run_node
from grpo_core.quiet import Tracebacks
from tests.conftest import REPO


def test_the_limit_is_the_setting_or_a_multiple_of_the_slowest_step_with_a_floor():
    assert phase_limit(20, None) == phase_limit(20, 500) == 20
    assert phase_limit(None, None) == FIRST_STEP_S  # compiles, loads and warm-up happen in the first step
    assert phase_limit(None, 1.0) == FLOOR_S
    assert phase_limit(None, 1000.0) == STEP_MULTIPLE * 1000.0


def record(rank: int, seq: int, phase: str, open_: bool, at: float, world: int = 6) -> PhaseRecord:
    return PhaseRecord(rank, world, 3, phase, seq, open_, at, 20.0, False)


def test_the_earliest_unfinished_phase_is_named_with_where_each_rank_was():
    records = [
        record(0, 10, "ref", True, 105.0),  # finished gen, waits in the next phase's collective
        record(1, 9, "gen", True, 100.0),  # the one that hangs
        record(2, 9, "gen", False, 104.0),  # finished gen, between phases
        record(3, 8, "sync", False, 90.0),  # had not begun step 3's gen
        record(4, 9, "gen", True, 101.0),
    ]  # and rank 5 wrote nothing: still setting up, or on a node whose records this launcher cannot see
    assert find_hang(records, now=119.0) is None  # 19 s into gen
    hang = find_hang(records, now=121.0)
    assert (hang.in_it, hang.past, hang.behind, hang.unheard) == ([1, 4], [0, 2], [3], [5])
    assert hang.describe() == (
        "the gen phase of step 3 did not finish on ranks 1, 4 within 20 s (ranks 0, 2 finished it; rank 3 had not "
        "reached it; rank 5 recorded no phase)"
    )
    assert find_hang([record(0, 9, "gen", False, 0.0)], now=1e9) is None  # between phases: the stuck guard's
    automatic = PhaseRecord(1, 2, 7, "update", 30, True, 0.0, 600.0, True)
    assert find_hang([automatic], now=601.0).describe() == (
        "the update phase of step 7 did not finish on rank 1 within 600 s (automatic; trainer.hang_timeout_s sets "
        "it) (rank 0 recorded no phase)"
    )
    assert ranks([7]) == "rank 7" and ranks([0, 1, 2, 3, 5, 8, 9]) == "ranks 0-3, 5, 8, 9"


def test_a_rank_records_each_phase_it_enters_and_leaves(tmp_path):
    recorder = PhaseRecorder(tmp_path, rank=1, world=2, hang_timeout_s=None)
    recorder.begin_step(1)
    with recorder.phase("gen"):
        [inside] = read_records(tmp_path)
        assert (inside.rank, inside.step, inside.phase, inside.seq, inside.open) == (1, 1, "gen", 1, True)
        assert inside.limit_s == FIRST_STEP_S and inside.automatic
    with recorder.phase("update"):
        pass
    recorder.end_step()
    [after] = read_records(tmp_path)
    assert (after.phase, after.seq, after.open) == ("update", 2, False)
    recorder.begin_step(2)
    with recorder.phase("gen"):
        assert read_records(tmp_path)[0].limit_s == FLOOR_S  # a step has finished: its multiple, at least the floor
    with pytest.raises(RuntimeError), recorder.phase("update"):
        raise RuntimeError("a phase that fails ends the rank")
    assert read_records(tmp_path)[0].open  # its record says where it was
    outside = PhaseRecorder(None, 0, 1, None)  # a rank not started by the launcher records nothing
    with outside.phase("gen"):
        assert outside.path is None


def test_the_terminal_gets_no_stack_dump():
    """faulthandler's dump of a rank's threads stays in the log (and its own file); the lines around it show."""
    lines = [
        "[default0]:step 2: reward=0.5",
        "[default1]:Thread 0x00007f742136b6c0 (most recent call first):",
        '[default1]:  File "/x/threading.py", line 331 in wait',
        "[default1]:",
        "[default1]:Current thread 0x00007f74c6bbcb80 (most recent call first):",
        '[default1]:  File "/x/reward.py", line 19 in compute_score',
        "[default0]:Stack (most recent call first):",
        '[default0]:  File "/x/distributed_c10d.py", line 4287 in all_gather',
        "[default1]:",
        "[default0]:saved checkpoint /c/step_000002",
    ]
    tracebacks = Tracebacks()
    shown = [line for line in lines if not tracebacks.hides(line)]
    assert shown == ["[default0]:step 2: reward=0.5", "[default0]:saved checkpoint /c/step_000002"]


SILENT_RANK = """
import sys, time
from grpo_core.diagnostics.watchdog import PhaseRecorder, arm_stack_dumps
arm_stack_dumps()
print("rank started", flush=True)
if sys.argv[1] == "hang":  # in a phase past its limit
    recorder = PhaseRecorder.from_env(hang_timeout_s=2)
    recorder.begin_step(1)
    with recorder.phase("gen"):
        time.sleep(120)
time.sleep(120)  # silent, outside any phase: the stuck guard's
"""


@pytest.mark.parametrize("guard", ["hang", "stuck"])
def test_a_rank_that_makes_no_progress_has_its_stack_dumped_and_is_killed(guard, tmp_path):
    """A stand-in for torchrun's agent with one "rank" (its child) that sleeps in a phase past its 2 s limit (the
    watchdog), or silently outside any phase (the stuck guard, 3 s): the launcher has it dump its stack into the
    node log, copied to node0-stacks.log, then kills it; the error says so in one line."""
    logs = NodeLogs(tmp_path)
    logs.phases.mkdir()
    (logs.phases / "rank5.json").write_text("{}")  # an earlier launch's record is not read
    rank = f"{shlex.quote(sys.executable)} -c {shlex.quote(SILENT_RANK)} {guard}; exit $?"
    env = {"PYTHONPATH": str(REPO), "RANK": "0", "WORLD_SIZE": "1"}
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        run_node(["bash", "-c", rank], logs, env=env, stuck_s=3 if guard == "stuck" else None, poll_s=0.2)
    assert time.monotonic() - start < 30
    error = str(caught.value)
    assert caught.value.kind == guard and "\n" not in error
    why = {"hang": "the gen phase of step 1 did not finish on rank 0 within 2 s", "stuck": "no output and no heart"}
    assert error.startswith(f"node 0: {guard}: {why[guard]}"), error
    assert f"; the ranks' Python stacks are in {logs.stacks} (log: {logs.node_log})" in error
    stacks = logs.stacks.read_text()
    assert "(most recent call first)" in stacks and "<module>" in stacks  # the rank's main thread, in its sleep
    assert not (logs.phases / "rank5.json").exists()


def test_grpo_train_exits_1_with_the_hang_in_one_line(monkeypatch, capsys):
    from grpo_core.cli import train
    from grpo_core.config.schema import GRPOConfig

    line = "node 0: hang: the gen phase of step 3 did not finish on rank 1 within 20 s (rank 0 finished it); …"

    def hanging(*args, **kwargs):
        raise LaunchError(line, kind="hang")

    monkeypatch.setattr("grpo_core.cli.train.run_training", hanging)
    assert train._launch(GRPOConfig(), argparse.Namespace(config=None, overrides=[])) == 1
    assert capsys.readouterr().err == f"error: {line}\n"


# --- a real hang: 2 ranks, gloo, the pipeline's train task --------------------------------------------------

HANG_S = 20
BLOCKING_ONCE = """
import json, os, time
from pathlib import Path

from grpo_core.rewards.capitals import compute_score as capitals

FLAG, METRICS = Path({flag!r}), Path({metrics!r})


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the capitals reward; on rank 1, once (the flag is taken), in step 3 (two steps logged): never returns
    if os.environ.get("RANK") == "1" and METRICS.is_file() and len(METRICS.read_text().splitlines()) >= 2:
        try:
            FLAG.rename(FLAG.with_suffix(".taken"))
        except FileNotFoundError:
            pass
        else:
            FLAG.with_suffix(".json").write_text(json.dumps({{"pid": os.getpid(), "at": time.time()}}))
            while True:
                time.sleep(1)
    return capitals(solution_str)
"""
TRAIN_FLOW = """
import json, sys
from prefect import flow
from grpo_core.config.load import load_config
from tasks.train import train_task

overrides = sys.argv[1:]


@flow(name="train-with-retries")
def train_with_retries() -> dict:
    return train_task(load_config(None, overrides))(None, overrides, "")


print("result: " + json.dumps(train_with_retries()))
"""


def seconds_until_it_ends(blocked: Path, ended: list[float], deadline: float) -> None:
    """Once the reward says it blocks (``blocked``: its pid and time), how long until that rank is gone."""
    from tests.test_launch import alive

    while not blocked.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    info = json.loads(blocked.read_text())
    while alive(info["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    ended.append(time.time() - info["at"])


def test_a_rank_blocked_in_a_collective_is_ended_within_the_limit_and_the_retried_task_finishes_the_run(tmp_path):
    """Rank 1's reward never returns in step 3, so rank 0 waits for it in the ref phase's gloo all-reduce (TP=2).
    After HANG_S s the launcher has both ranks dump their stacks (node0-stacks.log: rank 1 in the reward, rank 0
    in torch.distributed) and kills them; the pipeline's train task fails with one line naming the phase, the
    rank and the checkpoint left (step 2, which verifies), and its retry (tracking.train_retries, no delay here)
    resumes from it: steps 1-3 equal those of an uninterrupted run exactly, and nothing is left running.
    It also carries test_train's resume at TP=2 (a second invocation goes on after the last checkpoint)."""
    from grpo_core.checkpoint.manager import verify_checkpoint
    from tests.support.servers import prefect_env
    from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir
    from tests.test_launch import marked_pids
    from tests.test_train import UNTIMED, base_overrides, grpo_train, metrics

    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    model, data = tiny_model_dir(tmp_path / "model"), capitals_data(tmp_path / "data")
    flag, straight, run = tmp_path / "hang-once", tmp_path / "straight", tmp_path / "run"
    reward = tmp_path / "reward.py"
    reward.write_text(BLOCKING_ONCE.format(flag=str(flag), metrics=str(run / "metrics.jsonl")))
    common = [
        *base_overrides(model, data, 3),
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "trainer.save_freq=1",
        f"custom_reward_function.path={reward}",
        f"trainer.hang_timeout_s={HANG_S}",  # a healthy step takes a few seconds: no hang there
    ]
    uninterrupted = grpo_train(straight, *common)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-4000:]

    flag.touch()
    marker = f"{tmp_path.name}-hang"
    overrides = [*common, f"trainer.default_local_dir={run}", "tracking.train_retry_delay_s=0"]
    env = {
        **os.environ,
        **prefect_env(tmp_path / "prefect"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "GRPO_TEST_NODE": marker,
        "COLUMNS": "400",  # Prefect's console log lines unwrapped
    }
    ended: list[float] = []
    watch = threading.Thread(
        target=seconds_until_it_ends, args=(flag.with_suffix(".json"), ended, time.monotonic() + 600), daemon=True
    )
    watch.start()
    flow = subprocess.run(
        [sys.executable, "-c", TRAIN_FLOW, *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    watch.join(timeout=10)
    output = flow.stdout + flow.stderr
    assert flow.returncode == 0, output[-6000:]
    print(f"the blocked rank ended {ended[0]:.1f} s after it blocked (limit {HANG_S} s)")
    assert ended and ended[0] < HANG_S + 20, ended

    # the first attempt: one line, the stacks, a checkpoint that verifies
    checkpoints, launch = run / "checkpoints", run / "launch"
    line = (
        f"node 0: hang: the gen phase of step 3 did not finish on rank 1 within {HANG_S} s (rank 0 finished it); "
        "killed the job after "
    )
    assert line in output, output[-6000:]
    after = output[output.index(line) :].splitlines()[0]
    assert after.endswith(
        f"the ranks' Python stacks are in {launch / 'node0-stacks.log'} (log: {launch / 'node0.log'}); "
        f"the newest checkpoint is {checkpoints / 'step_000002'}"
    ), after
    assert "Retry 1/1" in output, output[-6000:]
    stacks = (launch / "node0-stacks.log").read_text()
    rank0 = "\n".join(line for line in stacks.splitlines() if line.startswith("[default0]:"))
    rank1 = "\n".join(line for line in stacks.splitlines() if line.startswith("[default1]:"))
    assert "(most recent call first)" in rank0 and "torch/distributed/distributed_c10d.py" in rank0, stacks
    assert f'File "{reward}"' in rank1 and "in compute_score" in rank1, stacks
    verify_checkpoint(checkpoints / "step_000002")
    assert not list(checkpoints.glob("*.partial"))

    # the retry: resumed from step 2, the rest of the run as if nothing had happened
    result = json.loads(output[output.index("result: ") + len("result: ") :].splitlines()[0])
    assert result["checkpoint"] == str(checkpoints / "step_000003") and result["steps"] == 3, result
    assert f"resumed from {checkpoints / 'step_000002'}" in (launch / "node0.log").read_text()
    got, expected = metrics(run), metrics(straight)
    assert [m["step"] for m in got] == [1, 2, 3]
    for mine, theirs in zip(got, expected, strict=True):
        assert {k: v for k, v in mine.items() if not k.startswith(UNTIMED)} == {
            k: v for k, v in theirs.items() if not k.startswith(UNTIMED)
        }, mine["step"]  # exactly
    assert not marked_pids(marker), "a process of the run outlived it"
