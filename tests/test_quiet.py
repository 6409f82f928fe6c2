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
