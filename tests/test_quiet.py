"""A quiet terminal: library chatter stays out of it (and in the run's log), the pipeline follows its steps."""

import json
import os
import subprocess
import sys

import pytest

from grpo_core.launch.run import LogEcho
from grpo_core.quiet import MARK, NOISE, is_marked, is_noise
from grpo_core.tracking.follow import following, new_rows, step_line
from tests.conftest import REPO

SITE = "/venv/lib/python3.11/site-packages"
# What megatron and torch print on a CPU machine without Apex or Transformer Engine (the list).
CHATTER = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "Using Megatron-FSDP without Transformer Engine",
    "Detected Megatron Core",
    "FutureWarning",
    "DeprecationWarning",
    "SyntaxWarning",
    "warnings.warn(",
)
# Issue 44's misleading or noisy lines of a successful run: none may reach the terminal.
MISLEADING = (
    "does not exist yet (write it with `grpo prepare`)",  # the pipeline writes the data itself
    "Finished in state",  # Prefect's, after every task: reads as if the run were done
    "Running hook '_let_go'",
    "Hook '_let_go'",
    "Creating initial MLflow database tables",
    "INFO mlflow",
    "data: {",  # a Python dict
    "grpo_core.launch.agent",  # the 400-character torchrun command line (kept in the node log and the run's log)
    "Params for bucket",  # megatron's bucket list: one record of many lines
    "\tdecoder.",
    "…",  # a progress bar cut to 80 columns
    "grpo ━",
)


def misleading_lines(terminal: str) -> list[str]:
    """The lines of ``terminal`` that hold one of ``MISLEADING``, or that say the uplift a second time."""
    lines = terminal.splitlines()
    found = [line for line in lines if any(m in line for m in MISLEADING)]
    uplift = [line for line in lines if line.startswith("accuracy ") and ", uplift " in line]
    return found + uplift[1:]


@pytest.mark.parametrize(
    "category,filename,message,noise",
    [
        (
            UserWarning,
            f"{SITE}/megatron/core/models/backends.py",
            "Apex is not installed. Falling back to Torch Norm",
            1,
        ),
        (
            UserWarning,
            f"{SITE}/megatron/core/optimizer/__init__.py",
            "Transformer Engine and Apex are not installed.",
            1,
        ),
        (DeprecationWarning, f"{SITE}/megatron/core/models/gpt/gpt_model.py", "GPTModel is deprecated", 1),
        (SyntaxWarning, f"{SITE}/megatron/core/x.py", "invalid escape sequence '\\d'", 1),
        (FutureWarning, f"{SITE}/torch/distributed/c10d_logger.py", "`reduce_scatter_tensor` is deprecated", 1),
        # not chatter: what is not in the table is shown
        (UserWarning, f"{SITE}/megatron/core/transformer/attention.py", "sequence length exceeds the maximum", 0),
        (DeprecationWarning, "/work/grpo_core/trainer/loop.py", "old call", 0),
        (UserWarning, f"{SITE}/torch/nn/modules/module.py", "Apex is not installed", 0),
    ],
)
def test_the_noise_table_names_the_known_harmless_warnings_only(category, filename, message, noise):
    assert is_noise(category, filename, message) == bool(noise)
    assert all(n.why for n in NOISE)


def test_the_launch_echo_leaves_out_the_lines_ranks_marked_as_library_chatter(tmp_path):
    log = tmp_path / "node0.log"
    log.write_text(f"[default0]:{MARK}UserWarning: Apex is not installed\n[default0]:step 1: reward=0.5\nlast")
    out = tmp_path / "echo.txt"
    with out.open("w") as f:
        LogEcho(lambda: log, f).copy(last=True)  # what the echo does once the launch has ended
    assert out.read_text() == "[default0]:step 1: reward=0.5\nlast\n"
    assert is_marked(f"0: [default3]:{MARK}x") and not is_marked("step 1: " + "x" * 50 + MARK)


def test_step_lines_and_following_a_metrics_file(tmp_path):
    row = {"step": 3, "reward/mean": 0.4125, "reward/accuracy": 0.375, "perf/throughput": 812.44, "timing/step": 9.46}
    assert step_line(row, 10) == "step 3/10: reward 0.412  accuracy 0.375  tokens/s 812.4  step time 9.5 s"
    assert step_line({"step": 1}, None) == "step 1: "
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n")  # an earlier run's row: not shown again
    seen = []
    with following(path, seen.append, poll_s=0.01), path.open("a") as f:
        f.write(json.dumps({"step": 2}) + "\n" + '{"step": 3')  # the third line is still being written
        f.flush()
    assert seen == [{"step": 2}]
    assert new_rows(path, 0)[0] == [{"step": 1}, {"step": 2}]
    # the trainer of a fresh run replaces the file (without the earlier rows), then appends: all its rows show
    seen.clear()
    with following(path, seen.append, poll_s=0.01):
        replaced = tmp_path / "metrics.tmp"
        replaced.write_text("")
        os.replace(replaced, path)
        path.write_text("".join(json.dumps({"step": s, "x": "y" * 20}) + "\n" for s in (1, 2)))
    assert [r["step"] for r in seen] == [1, 2]


@pytest.mark.parametrize(
    "args,first",
    [
        (["train", "--config", "configs/demo_cpu.yaml", "--dry-run"], "resolved config"),
        (["export", "no/such/step_000001", "out"], "error: no/such/step_000001"),
    ],
)
def test_a_command_that_imports_megatron_starts_with_its_own_line(args, first, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "grpo_core.cli", *args], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    output = done.stderr + done.stdout
    assert first in (done.stderr or done.stdout).lstrip("─ \n").splitlines()[0], output[:2000]
    assert not [c for c in CHATTER if c in output], output[:3000]


def test_library_info_and_log_only_records_go_to_the_log_our_info_and_every_warning_to_the_terminal():
    """Issue 44: Prefect's "Finished in state Completed()", its hooks and MLflow's set-up are library INFO: the run's
    log keeps them; a line the terminal shows in another form is marked LOG_ONLY; a many-line record (megatron's
    bucket list) is marked chatter on every line, so the launcher's echo leaves all of it out."""
    import io
    import logging

    from grpo_core import quiet

    def record(path: str, level: int = logging.INFO, **extra) -> logging.LogRecord:
        return logging.makeLogRecord({"name": "x", "levelno": level, "pathname": path, "msg": "m", **extra})

    prefect_engine = f"{SITE}/prefect/task_engine.py"
    assert quiet.is_quiet_record(record(prefect_engine))
    assert not quiet.is_quiet_record(record(prefect_engine, logging.WARNING))
    assert not quiet.is_quiet_record(record(str(REPO / "tasks" / "evaluate.py")))
    assert quiet.is_quiet_record(record(str(REPO / "flows" / "grpo_pipeline.py"), **{quiet.LOG_ONLY: True}))
    # issue 53: Prefect's engine's report of a failed task run (with its traceback) goes to the log, whole
    failed = record(prefect_engine, logging.ERROR, name="prefect.task_runs", msg="Task run failed with exception")
    try:
        raise ValueError("bad input")
    except ValueError:
        failed.exc_info = sys.exc_info()
    assert quiet.is_quiet_record(failed) and "Traceback (most recent call last)" in quiet._traceback_of(failed)
    assert not quiet.is_quiet_record(record(prefect_engine, logging.WARNING, name="prefect.task_runs"))
    assert not quiet.is_quiet_record(record(str(REPO / "tasks" / "train.py"), logging.ERROR, name="prefect.task_runs"))
    cached = record(prefect_engine, msg="Finished in state Cached(type=COMPLETED)", task_run_name="prepare_gsm8k-0")
    assert (
        quiet.cached_line(cached)
        == "prepare_gsm8k-0: the result of an earlier run with the same inputs (not run again)"
    )

    sink, out = quiet._Sink(), io.StringIO()
    sink.stream = out
    sink.write("INFO megatron: Params for bucket 1:\n\tdecoder.layers.0.weight")
    assert all(is_marked(line) for line in out.getvalue().splitlines()) and len(out.getvalue().splitlines()) == 2


def test_the_pipeline_passes_on_rank_zeros_set_up_lines_only():
    from grpo_core.launch.run import StatusLines

    seen = []
    StatusLines(seen.append).write(
        "[default0]:set-up: building the actor (1 s)\n[default0]:other\nset-up: ready (2 s)\n"
    )
    assert seen == ["set-up: building the actor (1 s)", "set-up: ready (2 s)"]
