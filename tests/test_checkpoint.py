"""Checkpoints on CPU (torchrun + gloo): a run killed during a save or during a step resumes from the
last complete checkpoint and reproduces the uninterrupted run's next steps exactly; a checkpoint
saved at TP=2 resumes at TP=1."""

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from grpo_core.checkpoint.manager import (
    STATE_FILE,
    CheckpointError,
    CheckpointManager,
    check_optimizer_layout,
    read_trainer_state,
    verify_checkpoint,
)
from grpo_core.checkpoint.manifest import file_hash, write_manifest
from tests.dist.launch import torchrun
from tests.test_actor import tiny_llama  # noqa: F401  (fixture)


def run(hf_dir, root, out, steps, nproc=1, tp=1, crash="none", per_rank=False, extra=()):
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
        *(["--per-rank"] if per_rank else []),
        *extra,
        check=crash == "none",
    )


def steps_of(out) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("straight")  # verl's save_contents with the Hugging Face files too
    run(tiny_llama, tmp / "ckpt", tmp / "out.jsonl", steps=4, extra=("--contents", "model,optimizer,extra,hf_model"))
    return tmp / "ckpt", steps_of(tmp / "out.jsonl")


@pytest.mark.parametrize("crash", ["save:3", "step:3", "disk:3"])
def test_killed_run_resumes_exactly(crash, tiny_llama, uninterrupted, tmp_path):  # noqa: F811
    """Killed in a save or a step, or out of disk space (RLIMIT_FSIZE) in a save: the next run resumes from the
    last complete checkpoint and reproduces the uninterrupted run."""
    root, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    proc = run(tiny_llama, root, out, steps=4, crash=crash)
    assert proc.returncode != 0
    manager = CheckpointManager(root)
    assert manager.latest().name == "step_000002"  # the half-written step 3 is never picked up
    if crash.startswith("save"):
        assert (root / "step_000003.partial").is_dir()
    if crash.startswith("disk"):
        assert proc.returncode == 1
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, proc.stderr[-3000:]
        assert errors[0].startswith(f"error: saving checkpoint {root / 'step_000003'} failed: rank 0: a write came up")
        assert errors[0].endswith(f"the partial save was removed, the newest complete checkpoint is {root}/step_000002")
        assert "[rank0]: Traceback" not in proc.stderr  # (torchrun itself reports the failed worker)
        assert "Exception in thread" not in proc.stderr  # the checkpoint writer's threads print no traceback
        assert not (root / "step_000003.partial").exists()
        verify_checkpoint(root / "step_000002")
    run(tiny_llama, root, out, steps=4)
    resumed, (_, straight) = steps_of(out), uninterrupted
    for step in (3, 4):
        assert resumed[step]["metrics"] == straight[step]["metrics"], step  # exactly, not approximately
        assert resumed[step]["log_probs"] == straight[step]["log_probs"]
    assert not (root / "step_000003.partial").exists()
    assert [p.name for p in manager.complete_checkpoints()] == ["step_000002", "step_000003", "step_000004"]


def test_a_killed_lora_run_resumes_exactly(tiny_llama, tmp_path):  # noqa: F811
    """LoRA (issue 37): killed in the save of step 3, the run resumes from step 2's checkpoint (the adapters and their
    Adam state, on the frozen base read again from the model) and reproduces the uninterrupted LoRA run exactly."""
    lora = ("--lora-rank", "4")
    straight = tmp_path / "straight.jsonl"
    run(tiny_llama, tmp_path / "straight", straight, steps=4, extra=lora)
    root, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    assert run(tiny_llama, root, out, steps=4, crash="save:3", extra=lora).returncode != 0
    assert CheckpointManager(root).latest().name == "step_000002"
    assert read_trainer_state(root / "step_000002")["lora"]["rank"] == 4
    run(tiny_llama, root, out, steps=4, extra=lora)
    resumed, uninterrupted = steps_of(out), steps_of(straight)
    assert resumed[1]["log_probs"] != resumed[4]["log_probs"]  # the adapters trained
    for step in (3, 4):
        assert resumed[step]["metrics"] == uninterrupted[step]["metrics"], step  # exactly, not approximately
        assert resumed[step]["log_probs"] == uninterrupted[step]["log_probs"]


def test_per_rank_optimizer_shards_resume_exactly(tiny_llama, uninterrupted, tmp_path):  # noqa: F811
    """dist_ckpt_optim_fully_reshardable=false: the optimizer saved as each rank's shards (no gathered copy)
    resumes the run exactly, and the checkpoint says which TP/PP it can be loaded at."""
    root, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    assert run(tiny_llama, root, out, steps=4, crash="step:3", per_rank=True).returncode != 0
    state = read_trainer_state(root / "step_000002")
    assert (state["optimizer_format"], state["optimizer_layout"]) == ("dp_reshardable", {"tp": 1, "pp": 1})
    run(tiny_llama, root, out, steps=4, per_rank=True)
    resumed, (_, straight) = steps_of(out), uninterrupted
    for step in (3, 4):
        assert resumed[step]["metrics"] == straight[step]["metrics"], step
        assert resumed[step]["log_probs"] == straight[step]["log_probs"]


def test_per_rank_optimizer_shards_at_dp2_resume_exactly(tiny_llama, tmp_path):  # noqa: F811
    """Two data-parallel ranks, each saving its own half of the distributed optimizer (and the model once between
    them) through the streaming writer: killed in step 3, the resumed run reproduces the uninterrupted one."""
    straight, root, out = tmp_path / "straight.jsonl", tmp_path / "ckpt", tmp_path / "out.jsonl"
    run(tiny_llama, tmp_path / "straight", straight, steps=4, nproc=2, per_rank=True)
    assert run(tiny_llama, root, out, steps=4, nproc=2, crash="step:3", per_rank=True).returncode != 0
    state = read_trainer_state(root / "step_000002")
    assert (state["optimizer_format"], state["optimizer_layout"]) == ("dp_reshardable", {"tp": 1, "pp": 1})
    run(tiny_llama, root, out, steps=4, nproc=2, per_rank=True)
    resumed, uninterrupted = steps_of(out), steps_of(straight)
    for step in (3, 4):
        assert resumed[step]["metrics"] == uninterrupted[step]["metrics"], step
        assert resumed[step]["log_probs"] == uninterrupted[step]["log_probs"]


def test_a_model_only_checkpoint_resumes_with_a_fresh_optimizer(tiny_llama, tmp_path, caplog):  # noqa: F811
    """actor.checkpoint.save_contents=[model, extra] (verl's key): the checkpoint holds no optimizer state, and a
    run resumed from it continues from the saved weights with Adam afresh: in bf16, where the optimizer keeps
    fp32 copies of the weights that must follow the loaded ones, exactly what the uninterrupted run gives when
    its Adam state is zeroed before that step."""
    root, out, ref_root, ref_out = tmp_path / "ckpt", tmp_path / "out.jsonl", tmp_path / "ref", tmp_path / "ref.jsonl"
    lean = ["--contents", "model,extra", "--dtype", "bfloat16"]
    assert run(tiny_llama, root, out, steps=3, crash="step:3", extra=lean).returncode != 0
    state = read_trainer_state(root / "step_000002")
    assert state["contents"] == ["extra", "model"] and "optimizer_format" not in state
    with_adam = tmp_path / "with_adam"
    run(tiny_llama, with_adam, tmp_path / "with_adam.jsonl", steps=1, extra=["--dtype", "bfloat16"])
    lean_bytes, full_bytes = (
        sum(f.stat().st_size for f in d.glob("*.distcp")) for d in (root / "step_000002", with_adam / "step_000001")
    )
    assert lean_bytes < full_bytes / 3, (lean_bytes, full_bytes)  # bf16 weights against + 12 B/param of Adam
    proc = run(tiny_llama, root, out, steps=3, extra=lean)
    assert "without its optimizer (save_contents did not hold it): Adam starts afresh" in proc.stderr
    run(tiny_llama, ref_root, ref_out, steps=3, extra=[*lean, "--forget-adam-at", "3"])
    resumed, reference = steps_of(out), steps_of(ref_out)
    assert resumed[2] == reference[2]
    assert resumed[3]["metrics"] == reference[3]["metrics"] and resumed[3]["log_probs"] == reference[3]["log_probs"]


def test_per_rank_optimizer_shards_refuse_another_tp_in_one_line(tmp_path):
    (tmp_path / STATE_FILE).write_text(
        json.dumps({"step": 2, "optimizer_format": "dp_reshardable", "optimizer_layout": {"tp": 2, "pp": 1}})
    )
    assert check_optimizer_layout(tmp_path, 2, 1) == "dp_reshardable"
    with pytest.raises(CheckpointError, match=r"each rank's shards at TP=2 PP=1 .* not loadable at TP=1 PP=1; resume"):
        check_optimizer_layout(tmp_path, 1, 1)
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 2}))  # before the format was recorded: gathered
    assert check_optimizer_layout(tmp_path, 1, 1) == "fully_reshardable"


def test_saved_at_tp2_resumes_at_tp1(tiny_llama, uninterrupted, tmp_path):  # noqa: F811
    root, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    run(tiny_llama, root, out, steps=2, nproc=2, tp=2)
    files = json.loads((root / "step_000002" / "manifest.json").read_text())["files"]
    assert {"rng/rank_0.pt", "rng/rank_1.pt"} <= set(files)  # written once, after both ranks' files
    assert {f for f in files if f.endswith(".distcp")} == {p.name for p in (root / "step_000002").glob("*.distcp")}
    run(tiny_llama, root, out, steps=3, nproc=1, tp=1)
    resumed, (_, straight) = steps_of(out), uninterrupted
    assert set(resumed) == {1, 2, 3}
    for key, value in straight[3]["metrics"].items():
        assert resumed[3]["metrics"][key] == pytest.approx(value, abs=1e-5), key
    assert torch.allclose(torch.tensor(resumed[3]["log_probs"]), torch.tensor(straight[3]["log_probs"]), atol=1e-5)


def test_export_writes_the_trained_actor_as_hugging_face(tiny_llama, uninterrupted, tmp_path, monkeypatch):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from grpo_core.evaluation.run import exported_model
    from tests.dist.actor_worker import synthetic_batch

    root, straight = uninterrupted
    checkpoint = tmp_path / "the run's final weights"  # a copy under any name, written before manifests existed
    shutil.copytree(root / "step_000004", checkpoint)
    (checkpoint / "manifest.json").unlink()
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
    # save_contents' hf_model wrote the same files with the checkpoint, and evaluation takes them as they are
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (root / "step_000004" / "hf" / name).read_bytes(), name
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("exported again"))
    assert exported_model(root / "step_000004") == root / "step_000004" / "hf"


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


def test_resume_mode(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    assert manager.resolve_resume("auto") is None
    assert manager.resolve_resume("disable") is None
    (tmp_path / "step_000005.partial").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.resolve_resume(str(tmp_path / "step_000005.partial"))
    assert manager.resolve_resume("auto") is None
    for step in (1, 2):  # complete (a trainer state) but no shards: damaged, each named once
        (tmp_path / f"step_00000{step}").mkdir()
        (tmp_path / f"step_00000{step}" / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .* \(all 2 damaged"):
        manager.resolve_resume("auto")  # not a fresh start, which would purge them
    named = [r.getMessage().split(": ")[2] for r in caplog.records if r.levelname == "WARNING"]
    assert named == [str(tmp_path / "step_000002" / ".metadata"), str(tmp_path / "step_000001" / ".metadata")]


# ---- damaged checkpoints: each fault on a copy of the uninterrupted run's checkpoints -------------------------


class RunsACommand:
    """A pickle that runs a command when loaded: what torch's weights_only and the metadata check refuse."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def cut(path: Path, size: int = 100_000) -> None:
    os.truncate(path, size)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def command_pickle(path: Path) -> None:
    path.write_bytes(pickle.dumps(RunsACommand(path.parent / "PWNED")))


def _rewrite_item(shard: Path, pick, value) -> str:
    """Replace one item of ``shard`` (the first its .metadata lists that ``pick(fqn, is_bytes)`` takes) by
    ``value`` (torch.save'd, appended to the shard), point the metadata at it and rebuild the manifest, as
    whoever could write the checkpoint could; the item's name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    root = shard.parent
    metadata = pickle.loads((root / ".metadata").read_bytes())
    index, info = next(
        (i, info)
        for i, info in metadata.storage_data.items()
        if info.relative_path == shard.name
        and pick(i.fqn, isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
    )
    data = io.BytesIO()
    torch.save(value(shard, info) if callable(value) else value, data)
    metadata.storage_data[index] = dataclasses.replace(info, offset=shard.stat().st_size, length=len(data.getvalue()))
    with open(shard, "ab") as f:
        f.write(data.getvalue())
    (root / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(root)
    return index.fqn


def command_in_a_byte_item(shard: Path) -> None:
    """A layer's ``_extra_state`` (a pickled item of the shard) replaced by a pickle that runs a command."""
    _rewrite_item(shard, lambda fqn, is_bytes: is_bytes, [RunsACommand(shard.parent / "PWNED")])


def nan_weights(shard: Path) -> None:
    """A model tensor of the shard replaced by NaNs of its shape (what a diverged run used to save)."""

    def nans(shard, info):
        with open(shard, "rb") as f:
            f.seek(info.offset)
            return torch.full_like(torch.load(io.BytesIO(f.read(info.length)), weights_only=True), float("nan"))

    _rewrite_item(shard, lambda fqn, is_bytes: not is_bytes and not fqn.startswith("optimizer."), nans)


# (name, file, damage, keep the manifest, what the error line says: the kind, then after the file's path)
DAMAGE = [
    ("cut shard", "__0_0.distcp", cut, True, "damaged", ": 100000 bytes, the manifest says"),
    ("changed shard", "__0_1.distcp", flip_a_byte, True, "damaged", ": content differs from the manifest (hash"),
    ("missing file", "rng/rank_0.pt", os.unlink, True, "damaged", ": missing (listed in the manifest)"),
    ("cut shard, no manifest", "__0_0.distcp", cut, False, "damaged", ": truncated: 100000 bytes, the metadata needs"),
    ("command pickle as common.pt, no manifest", "common.pt", command_pickle, False, "unsafe", ": refused: not plain"),
    ("command pickle as .metadata, no manifest", ".metadata", command_pickle, False, "unsafe", ": not torch"),
    (
        "command pickle in a shard's item, manifest rebuilt",
        "__0_1.distcp",
        command_in_a_byte_item,
        True,
        "unsafe",
        "._extra_state/shard_0_4: refused: not plain tensors and numbers (torch.load(weights_only=True): ",
    ),
    ("NaN weights, manifest rebuilt", "__0_0.distcp", nan_weights, True, "non-finite", " NaN or infinite value(s)"),
]


def damaged_copy(uninterrupted, tmp_path, file, damage, keep_manifest) -> Path:
    root, _ = uninterrupted
    checkpoint = tmp_path / "copy"
    shutil.copytree(root / "step_000004", checkpoint)
    if not keep_manifest:
        (checkpoint / "manifest.json").unlink()
    damage(checkpoint / file)
    return checkpoint


def test_every_save_has_a_manifest_of_all_its_files(uninterrupted):
    root, _ = uninterrupted
    checkpoint = root / "step_000004"
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(files) == on_disk
    assert {"trainer_state.json", ".metadata", "common.pt", "rng/rank_0.pt"} <= on_disk
    for name, entry in files.items():
        assert entry == {"size": (checkpoint / name).stat().st_size, "hash": file_hash(checkpoint / name)}
    assert file_hash(checkpoint / "common.pt") == xxhash.xxh3_128((checkpoint / "common.pt").read_bytes()).hexdigest()


def test_verify_reports_an_intact_checkpoint_and_its_speed(uninterrupted, capsys):
    from grpo_core.cli import main

    root, _ = uninterrupted
    assert main(["verify", str(root / "step_000004")]) == 0
    line = capsys.readouterr().out
    assert "step_000004: intact; " in line and "files; every file matches its manifest" in line and "GB/s" in line


@pytest.mark.parametrize(
    ("file", "damage", "keep_manifest", "kind", "says"), [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE]
)
def test_verify_names_the_damaged_file(file, damage, keep_manifest, kind, says, uninterrupted, tmp_path, capsys):
    from grpo_core.cli import main

    checkpoint = damaged_copy(uninterrupted, tmp_path, file, damage, keep_manifest)
    assert main(["verify", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {kind} checkpoint: {checkpoint / file}: "), err
    assert says in errors[0], err
    assert not (checkpoint / "PWNED").exists()


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "grpo_core.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def one_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize(
    "command,case",
    [("export", 0), ("export", 6), ("evaluate", 6)],
    ids=[f"export, {DAMAGE[0][0]}", f"export, {DAMAGE[6][0]}", f"evaluate, {DAMAGE[6][0]}"],
)
def test_loading_a_damaged_checkpoint_is_one_line_and_exit_2(command, case, uninterrupted, tmp_path):
    from tests.support.tiny import capitals_data

    _, file, damage, keep_manifest, kind, says = DAMAGE[case]
    checkpoint = damaged_copy(uninterrupted, tmp_path, file, damage, keep_manifest)
    if command == "export":
        proc = cli("export", str(checkpoint), str(tmp_path / "out"))
    else:
        data = capitals_data(tmp_path / "data") / "test.parquet"
        proc = cli("evaluate", "--model", str(checkpoint), "--data", str(data), "--output", str(tmp_path / "out"))
    error = one_error(proc)
    assert error.startswith(f"error: {kind} checkpoint: {checkpoint / file}: ") and says in error, error
    assert not (checkpoint / "PWNED").exists() and not (tmp_path / "out").exists()
    assert not (checkpoint / "hf.partial").exists()  # nothing exported; the saved hf/ is not read past the damage


def test_a_pickle_in_a_checkpoint_never_runs_even_unchecked(tmp_path, monkeypatch):
    """The second guard, for a file changed after its check: every torch.load of a grpo_core process is
    weights-only (torch's switch, set by importing grpo_core), so torch's checkpoint planner, which unpickles
    byte items with weights_only=False, refuses the payload that runs without the switch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import grpo_core  # noqa: F401

    marker = tmp_path / "PWNED"
    dcp.save({"extra_state": [RunsACommand(marker)]}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] == "1"
    with pytest.raises(CheckpointException, match="unsupported GLOBAL posix.system"):
        dcp.load({"extra_state": io.BytesIO()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert not marker.exists()
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")  # what the payload does without it
    dcp.load({"extra_state": io.BytesIO()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert marker.exists()


def test_torch_s_own_read_of_a_swapped_metadata_runs_nothing(tmp_path):
    """The window between the check and the load for ``.metadata``: torch's reader unpickles it with plain pickle,
    which the weights-only switch does not reach; with grpo_core's checks imported it refuses a command pickle put
    there after the check, and still reads a real one (and still writes them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import grpo_core.checkpoint.contents  # noqa: F401  (the guard is installed on import)

    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata["w"].size == torch.Size([3])
    marker = tmp_path / "PWNED"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    with pytest.raises(pickle.UnpicklingError, match="refused global posix.system"):
        FileSystemReader(tmp_path / "ckpt").read_metadata()
    assert not marker.exists()


def test_auto_resume_skips_an_unsafe_newest_checkpoint(uninterrupted, tmp_path, caplog):
    src, _ = uninterrupted
    root = tmp_path / "ckpt"
    for step in ("step_000003", "step_000004"):
        shutil.copytree(src / step, root / step)
    command_in_a_byte_item(root / "step_000004" / "__0_1.distcp")
    assert CheckpointManager(root).resolve_resume("auto") == root / "step_000003"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: unsafe checkpoint: {root / 'step_000004'}")
    assert not (root / "step_000004" / "PWNED").exists()


def test_latest_names_a_checkpoint_of_this_run_only(uninterrupted, tmp_path, caplog):
    """`checkpoints/latest` is a name in this run's directory, never a path: one that leads to another run's
    checkpoint (an absolute path, `..`, a symbolic link) is ignored, and a stale one loses to the newest intact
    checkpoint, each with one warning. Auto-resume takes this run's newest intact checkpoint (it took the other
    run's, whose resume then overwrote this run's newer steps)."""
    src, _ = uninterrupted
    root, other = tmp_path / "run" / "checkpoints", tmp_path / "other" / "checkpoints"
    for step in ("step_000002", "step_000003"):
        shutil.copytree(src / step, root / step)
    shutil.copytree(src / "step_000004", other / "step_000004")
    (other / "latest").write_text("step_000004")
    manager, newest, pointer = CheckpointManager(root), root / "step_000003", root / "latest"
    ignored = f"; ignored: resuming from {newest}, this run's newest intact checkpoint"
    cases = [
        (str(other / "step_000004"), f"names '{other / 'step_000004'}', an absolute path{ignored}"),
        (
            "../../other/checkpoints/step_000004",
            f"names '../../other/checkpoints/step_000004', a path out of this directory (..){ignored}",
        ),
        ("step_000004", f"names step_000004, a symbolic link (to {other / 'step_000004'}){ignored}"),
        (other / "latest", f"is a symbolic link (to {other / 'latest'}), not a checkpoint's name{ignored}"),
        ("step_000002", f"names step_000002, but {newest} is this run's newest intact checkpoint; resuming from it"),
        ("step_000003", None),
    ]
    (root / "step_000004").symlink_to(other / "step_000004")
    for name, says in cases:
        pointer.unlink(missing_ok=True)
        if isinstance(name, Path):
            pointer.symlink_to(name)
        else:
            pointer.write_text(name)
        caplog.clear()
        assert manager.resolve_resume("auto") == newest and manager.latest() == newest, name
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warnings == ([f"warning: {pointer} {says}"] if says else []), name


def tamper(checkpoint: Path, name: str, change) -> None:
    """``change`` (record -> record, or None: it changes the file itself) applied to the JSON record ``name`` of
    ``checkpoint``; a changed trainer state gets a manifest rebuilt over it, as whoever changed it could rebuild one:
    the content itself must be refused."""
    path = checkpoint / name
    if (changed := change(json.loads(path.read_text()))) is not None:
        path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
        if name == STATE_FILE:
            write_manifest(checkpoint)


def too_large(path: Path):
    """A change that makes the file 300 MB (sparse): refused before a byte of it is parsed."""
    return lambda record: os.truncate(path, 300 << 20)


ROWS_SEEN_AS_A_STRING = (
    lambda s: {**s, "rows_seen": "0123456789abcdef"},
    "field 'rows_seen': expected a list, got a string",
)
RECORD_CASES = {  # name: (file, its change, what the error says after "FILE: ")
    "trainer state: a count as a string": (
        STATE_FILE,
        lambda s: {**s, "data_position": "4"},
        "field 'data_position': expected an integer, got a string",
    ),
    "trainer state: rows_seen as a string (read as its characters before)": (STATE_FILE, *ROWS_SEEN_AS_A_STRING),
    "trainer state: an absurd model size (an export allocated it)": (
        STATE_FILE,
        lambda s: {**s, "hf_config": {**s["hf_config"], "vocab_size": 25 * 10**9}},
        "field 'hf_config.vocab_size': expected at most 4194304, got 25000000000",
    ),
    "trainer state: not a JSON object": (
        STATE_FILE,
        lambda s: "[4]",
        "unreadable trainer state: expected an object, got a list",
    ),
    "trainer state: 300 MB": (
        STATE_FILE,
        None,
        "314572800 bytes, more than a trainer state can be (268.435 MB at most)",
    ),
    "manifest: sizes as strings": (
        "manifest.json",
        lambda m: {**m, "files": {k: {**v, "size": str(v["size"])} for k, v in m["files"].items()}},
        "field 'files[.metadata].size': expected an integer, got a string",
    ),
    "manifest: a file outside the checkpoint": (
        "manifest.json",
        lambda m: {**m, "files": {"../../elsewhere": {"size": 1, "hash": "0" * 32}}},
        "field 'files[../../elsewhere]': expected a path inside its directory (relative, no '..'), got "
        "'../../elsewhere'",
    ),
}


def test_records_of_a_checkpoint_that_do_not_validate_are_one_line_and_exit_2(uninterrupted, tmp_path, capsys):
    """Issue 53: the trainer state and the manifest are typed and bounded (grpo_core/records): a field of the wrong
    type, an absurd size, rows_seen as a string, a file too large to be one, a manifest naming a file outside the
    checkpoint are each one line naming the file and the field, exit 2, from `grpo verify` and `grpo export` (which
    allocated the model the state said, or read a string as its characters, before), and `grpo train` refuses to
    resume from it before any rank starts."""
    from grpo_core.cli import main
    from tests.support.tiny import capitals_data, tiny_model_dir
    from tests.test_train import base_overrides

    root, _ = uninterrupted
    checkpoint, out = tmp_path / "copy", tmp_path / "out"
    shutil.copytree(root / "step_000004", checkpoint)
    written = {name: (checkpoint / name).read_bytes() for name in (STATE_FILE, "manifest.json")}
    for case, (name, change, says) in RECORD_CASES.items():
        for original, data in written.items():
            (checkpoint / original).write_bytes(data)
        tamper(checkpoint, name, change or too_large(checkpoint / name))
        for command in (["verify", str(checkpoint)], ["export", str(checkpoint), str(out)]):
            assert main(command) == 2, (case, command)
            err = capsys.readouterr().err
            assert [line for line in err.splitlines() if line.startswith("error:")] == [
                f"error: damaged checkpoint: {checkpoint / name}: {says}"
            ], (case, command, err)
            assert "Traceback" not in err and not out.exists()
    for original, data in written.items():
        (checkpoint / original).write_bytes(data)
    tamper(checkpoint, STATE_FILE, ROWS_SEEN_AS_A_STRING[0])
    run = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir(tmp_path / "model"), capitals_data(tmp_path / "data"), 1)
    overrides += [f"trainer.default_local_dir={run}", f"trainer.resume_mode={checkpoint}"]
    assert main(["train", "--dry-run", *overrides]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: trainer.resume_mode: damaged checkpoint: {checkpoint / STATE_FILE}: {ROWS_SEEN_AS_A_STRING[1]}"
    ], err
    assert not run.exists()


def test_auto_resume_skips_a_newest_checkpoint_whose_trainer_state_does_not_validate(uninterrupted, tmp_path, caplog):
    """A trainer state that does not validate marks its checkpoint damaged: auto-resume falls back to the newest
    sound one, saying so in one warning (it resumed with rows_seen read as the characters of a string)."""
    src, _ = uninterrupted
    root = tmp_path / "ckpt"
    for step in ("step_000003", "step_000004"):
        shutil.copytree(src / step, root / step)
    tamper(root / "step_000004", STATE_FILE, ROWS_SEEN_AS_A_STRING[0])
    assert CheckpointManager(root).resolve_resume("auto") == root / "step_000003"
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"warning: damaged checkpoint: {root / 'step_000004' / STATE_FILE}: {ROWS_SEEN_AS_A_STRING[1]}; skipped, "
        "resuming from an older checkpoint if one is intact"
    ]


def test_export_of_another_models_shards_is_one_line_and_exit_2(uninterrupted, tmp_path):
    """The trainer state says one model, the shards hold another (shapes differ): refused by megatron's loader."""
    from grpo_core.checkpoint.manifest import write_manifest

    checkpoint = damaged_copy(uninterrupted, tmp_path, "trainer_state.json", lambda p: None, True)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["hf_config"]["intermediate_size"] = 96
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(checkpoint)  # intact files, of another model
    error = one_error(cli("export", str(checkpoint), str(tmp_path / "out")))
    assert error.startswith(f"error: {checkpoint}: cannot load it into this model: "), error
    assert "shape" in error


def test_resume_skips_a_damaged_newest_checkpoint_with_one_warning(tiny_llama, uninterrupted, tmp_path):  # noqa: F811
    src, straight = uninterrupted
    root, out = tmp_path / "ckpt", tmp_path / "out.jsonl"
    shutil.copytree(src, root)
    cut(root / "step_000004" / "__0_0.distcp")
    proc = run(tiny_llama, root, out, steps=4)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: damaged checkpoint")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert f"{root / 'step_000004' / '__0_0.distcp'}: 100000 bytes, the manifest says" in warnings[0]
    resumed = steps_of(out)
    assert set(resumed) == {4}  # resumed from step 3, the newest intact one
    assert resumed[4]["metrics"] == straight[4]["metrics"] and resumed[4]["log_probs"] == straight[4]["log_probs"]
    verify_checkpoint(root / "step_000004")  # written anew, whole


@pytest.mark.parametrize("fault", ["damaged", "unsafe", "another model", "per-rank shards of another TP"])
def test_train_refuses_a_damaged_or_foreign_checkpoint_before_any_rank_starts(fault, uninterrupted, tmp_path):
    """trainer.resume_mode=PATH: checked by `grpo train` itself, in one line, before torchrun starts a rank."""
    from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir
    from tests.test_train import base_overrides, grpo_train

    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    root, _ = uninterrupted
    checkpoint = tmp_path / "given"
    shutil.copytree(root / "step_000004", checkpoint)
    if fault == "damaged":
        cut(checkpoint / "__0_0.distcp")
        says = f"error: damaged checkpoint: {checkpoint / '__0_0.distcp'}: 100000 bytes, the manifest says"
    elif fault == "unsafe":
        command_in_a_byte_item(checkpoint / "__0_1.distcp")
        says = f"error: unsafe checkpoint: {checkpoint / '__0_1.distcp'}: item "
    elif fault == "another model":  # the checkpoint's model: 4 layers and 256 tokens; the tiny model's: 2 and 49152
        says = f"error: {checkpoint / 'trainer_state.json'}: the checkpoint is of another model (num_layers 4 there"
    else:  # saved with dist_ckpt_optim_fully_reshardable=false at TP=2, resumed at TP=1
        state = json.loads((checkpoint / STATE_FILE).read_text())
        state |= {"optimizer_format": "dp_reshardable", "optimizer_layout": {"tp": 2, "pp": 1}}
        (checkpoint / STATE_FILE).write_text(json.dumps(state))
        write_manifest(checkpoint)
        says = f"error: {checkpoint}: its optimizer state is each rank's shards at TP=2 PP=1"
    run = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir(tmp_path / "model"), capitals_data(tmp_path / "data"), 1)
    proc = grpo_train(run, *overrides, f"trainer.resume_mode={checkpoint}")
    assert one_error(proc).startswith(says), proc.stderr[-2000:]
    assert not (run / "launch").exists() and not (checkpoint / "PWNED").exists()


def test_train_refuses_to_resume_a_data_position_in_another_training_set(uninterrupted, tmp_path):
    """Issue 38: rows appended to the training set while a run's checkpoint is mid-epoch. Its data position counts
    batches of the old set's order, so `grpo train` (resume_mode=auto, as the pipeline's retry runs it) refuses
    in one line naming both sets' digests and what to do, before any rank starts: never a silent skip or repeat."""
    from grpo_core.data.lineage import dataset_digest
    from grpo_core.data.prompts import seen_digest
    from grpo_core.models.shape import read_hf_config
    from tests.support.tiny import TOKENIZER, capitals_data, tiny_model_dir
    from tests.test_train import base_overrides, grpo_train

    if not TOKENIZER.is_dir():
        pytest.skip(f"{TOKENIZER} (the shared SmolLM2 tokenizer) is not present")
    root, _ = uninterrupted
    model, data = tiny_model_dir(tmp_path / "model"), capitals_data(tmp_path / "data", rows=20)
    before = dataset_digest([data / "train.parquet"])
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000003"
    shutil.copytree(root / "step_000003", checkpoint)
    # as a run of this model on those 20 rows saved it: batches of 8, two an epoch, three drawn (mid-epoch 2)
    state = json.loads((checkpoint / STATE_FILE).read_text())
    state |= {"hf_config": read_hf_config(str(model)), "data_position": 3}
    state["data"] = {"train_digest": before, "rows": 20, "seen_sha256": seen_digest(frozenset())}
    (checkpoint / STATE_FILE).write_text(json.dumps(state))
    write_manifest(checkpoint)
    capitals_data(tmp_path / "data", rows=24)  # 4 rows appended
    after = dataset_digest([data / "train.parquet"])
    proc = grpo_train(run, *base_overrides(model, data, 4))
    assert one_error(proc) == (
        f"error: {checkpoint / STATE_FILE}: its data position (3 batches) counts in another training set (digest "
        f"{before[:12]} there, {after[:12]} here), so resuming would skip or repeat rows; train afresh "
        "(trainer.resume_mode=disable or a new trainer.default_local_dir), from its weights if you like: "
        f"`grpo export {checkpoint} DIR`, then actor_rollout_ref.model.path=DIR (the rows it drew come last)"
    )
    assert not (run / "launch").exists()  # no rank started
