"""Checkpoints on CPU (torchrun + gloo): a run killed during a save or during a step resumes from the
last complete checkpoint and reproduces the uninterrupted run's next steps exactly; a checkpoint
saved at TP=2 resumes at TP=1."""

import json
import os
import subprocess
import sys

import pytest
import torch

from grpo_core.trainer.checkpoint import CheckpointError, CheckpointManager
from tests.dist.launch import torchrun
from tests.test_actor import tiny_llama  # noqa: F401  (fixture)


def run(hf_dir, root, out, steps, nproc=1, tp=1, crash="none"):
    return torchrun(
        "ckpt_worker.py",
        nproc,
        "--hf-dir",
        str(hf_dir),
        "--root",
        str(root),
        "--steps",
        str(steps),
        "--tp",
        str(tp),
        "--crash",
        crash,
        "--out",
        str(out),
        check=crash == "none",
    )


def steps_of(out) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("straight")
    run(tiny_llama, tmp / "ckpt", tmp / "out.jsonl", steps=4)
    return tmp / "ckpt", steps_of(tmp / "out.jsonl")


@pytest.mark.parametrize("crash", ["save:3", "step:3"])
def test_killed_run_resumes_exactly(crash, tiny_llama, uninterrupted, tmp_path):  # noqa: F811
    root, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    proc = run(tiny_llama, root, out, steps=4, crash=crash)
    assert proc.returncode != 0
    manager = CheckpointManager(root)
    assert manager.latest().name == "step_000002"  # the half-written step 3 is never picked up
    if crash.startswith("save"):
        assert (root / "step_000003.partial").is_dir()
    run(tiny_llama, root, out, steps=4)
    resumed, (_, straight) = steps_of(out), uninterrupted
    for step in (3, 4):
        assert resumed[step]["metrics"] == straight[step]["metrics"], step  # exactly, not approximately
        assert resumed[step]["log_probs"] == straight[step]["log_probs"]
    assert not (root / "step_000003.partial").exists()
    assert [p.name for p in manager.complete_checkpoints()] == ["step_000002", "step_000003", "step_000004"]


def test_saved_at_tp2_resumes_at_tp1(tiny_llama, uninterrupted, tmp_path):  # noqa: F811
    root, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    run(tiny_llama, root, out, steps=2, nproc=2, tp=2)
    run(tiny_llama, root, out, steps=3, nproc=1, tp=1)
    resumed, (_, straight) = steps_of(out), uninterrupted
    assert set(resumed) == {1, 2, 3}
    for key, value in straight[3]["metrics"].items():
        assert resumed[3]["metrics"][key] == pytest.approx(value, abs=1e-5), key
    assert torch.allclose(torch.tensor(resumed[3]["log_probs"]), torch.tensor(straight[3]["log_probs"]), atol=1e-5)


def test_export_writes_the_trained_actor_as_hugging_face(tiny_llama, uninterrupted, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from tests.dist.actor_worker import synthetic_batch

    root, straight = uninterrupted
    checkpoint = root / "step_000004"
    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_core.cli", "export", str(checkpoint), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    batch = synthetic_batch(model.config.vocab_size, rows=8)
    batch.input_ids = (batch.input_ids + 4) % model.config.vocab_size  # step 4's data
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    r = batch.response_length
    log_probs = torch.log_softmax(logits[:, -r - 1 : -1].float(), -1).gather(-1, batch.responses[..., None])[..., 0]
    expected = torch.tensor(straight[4]["log_probs"])
    mask = batch.response_mask.bool()
    assert torch.allclose(log_probs[mask], expected[mask], atol=1e-4)


def test_export_of_a_partial_checkpoint_exits_2(tmp_path):
    (tmp_path / "step_000001.partial").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_core.cli", "export", str(tmp_path / "step_000001.partial"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and "not a complete checkpoint" in proc.stderr and "Traceback" not in proc.stderr


def test_save_interval():
    manager = CheckpointManager("unused", save_freq=5)
    assert [step for step in range(1, 13) if manager.should_save(step, last_step=step == 12)] == [5, 10, 12]
    assert not CheckpointManager("unused", save_freq=-1).should_save(5, last_step=False)


def test_resume_mode(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.resolve_resume("auto") is None
    assert manager.resolve_resume("disable") is None
    (tmp_path / "step_000005.partial").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.resolve_resume(str(tmp_path / "step_000005.partial"))
    assert manager.resolve_resume("auto") is None
