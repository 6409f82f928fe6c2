"""Checkpoints that a crash can never half-write and that prove they are whole: megatron dist checkpoints plus
the trainer's state.

Layout under ``root``::

    step_000010/          model + optimizer (megatron dist_checkpointing, reshardable), trainer_state.json,
                          rng/rank_<r>.pt, manifest.json (every file's size and hash: see manifest.py)
    step_000012.partial/  a save in progress (or killed, or failed): never loaded, removed by the next save
    latest                the name of the newest complete checkpoint, replaced atomically (for people and tools:
                          resuming takes the newest intact checkpoint, and says so when ``latest`` disagrees)

All ranks write into ``step_N.partial``; after a barrier rank 0 writes ``trainer_state.json``, then the
manifest of every rank's files, and renames the directory (atomic on POSIX), then points ``latest`` at it.
A checkpoint is complete when its directory (under any name but ``*.partial``) holds ``trainer_state.json``;
it is intact when its files match its manifest (``verify_checkpoint``), which every load checks first.
A save that fails (a full disk) removes its partial directory and raises CheckpointSaveError.
"""

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from grpo_core.atomic import write_text_atomic
from grpo_core.checkpoint import manifest
from grpo_core.checkpoint.contents import check_contents
from grpo_core.checkpoint.manifest import DamagedFile, Verified
from grpo_core.config.defaults import SETTING, defaults_from, schema_default
from grpo_core.numerics import NotFinite
from grpo_core.records.checkpoint import TrainerState
from grpo_core.records.reader import RecordError, read_json_as_written

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
# actor.checkpoint.save_contents / load_contents (verl's names): the model always; Adam's state; "extra" is the lr
# schedule's position and the RNG states. The trainer state (step, data position) is always written.
FULL_CONTENTS = frozenset({"model", "optimizer", "extra"})
HF_EXPORT = "hf"  # a checkpoint's Hugging Face files (save_contents' hf_model, or `grpo export` into it)
RESUMED_WITHOUT = {
    "optimizer": "Adam starts afresh from the saved weights",
    "extra": "the lr schedule starts from its first step and the RNG states start fresh",
}
_STEP_DIR = re.compile(r"step_([0-9]+)")  # fullmatch
LATEST = "latest"  # the newest checkpoint's name
POINTER_BYTES = 256  # read of ``latest``: a name is far shorter


class CheckpointError(Exception):
    """A checkpoint asked for cannot be used; the message says why."""


class CheckpointSaveError(Exception):
    """A save failed for a reason of the environment (a full disk, a lost mount); its partial directory is gone."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(".partial") and (path / STATE_FILE).is_file()


def read_trainer_state(path: Path) -> dict:
    path = Path(path)
    if not is_complete(path):
        why = (
            "no such directory"
            if not path.is_dir()
            else "a save that did not finish (.partial)"
            if path.name.endswith(".partial")
            else f"no {STATE_FILE} in it"
        )
        raise CheckpointError(f"{path} is not a complete checkpoint: {why}")
    try:  # typed and bounded (records/checkpoint.py): a state that does not fit it marks the checkpoint damaged
        return read_json_as_written(path / STATE_FILE, TrainerState)
    except RecordError as e:
        raise CheckpointError(f"damaged checkpoint: {e}") from None


def describe_checkpoint(path: str | Path) -> str:
    """``…/step_000003 (1.08 GB: model, extra, hf_model)``: what a run wrote and how large, for its closing lines."""
    path = Path(path)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    try:
        contents = ", ".join(sorted(saved_contents(read_trainer_state(path))))
    except CheckpointError:
        contents = "contents unknown"
    return f"{path} ({size / 1e9:.2f} GB: {contents})"


def verify_checkpoint(path: str | Path) -> Verified:
    """A complete checkpoint whose trainer state is of its schema (records/checkpoint.py), whose files are whole
    (manifest.verify) and hold plain, finite data (contents.check_contents), and whose state says its step;
    CheckpointError naming the bad file (and field) otherwise."""
    path = Path(path)
    state = read_trainer_state(path)
    try:
        verified = manifest.verify(path)
        start = time.perf_counter()
        check_contents(path)
    except DamagedFile as e:
        raise CheckpointError(f"{e.kind} checkpoint: {e}") from None
    if "step" not in state:  # every save writes it; a resume starts from it
        raise CheckpointError(f"damaged checkpoint: {path / STATE_FILE}: field 'step': missing")
    return dataclasses.replace(verified, contents_seconds=time.perf_counter() - start)


def check_same_model(path: Path, shape) -> None:
    """CheckpointError when the checkpoint at ``path`` holds another model than ``shape`` (a ModelShape)."""
    from grpo_core.models.shape import ModelShape

    saved = read_trainer_state(path).get("hf_config")
    if saved is None:
        return
    theirs = ModelShape.from_hf_config(saved)
    if diff := [f"{k} {v} there, {getattr(shape, k)} here" for k, v in vars(theirs).items() if getattr(shape, k) != v]:
        raise CheckpointError(
            f"{Path(path) / STATE_FILE}: the checkpoint is of another model ({', '.join(diff[:3])}); "
            "resume with the model it was trained from, or set trainer.resume_mode=disable"
        )


def check_same_adapters(path: Path, lora: dict | None) -> None:
    """CheckpointError when the checkpoint's LoRA adapters (trainer state ``lora``: settings and base model) do not
    fit this run's ``lora`` (the same record, None without LoRA): adapters only mean something on their base."""
    saved = read_trainer_state(path).get("lora")
    if saved == lora:
        return
    where = Path(path) / STATE_FILE
    if saved is None or lora is None:
        has = "holds the whole model" if saved is None else f"holds LoRA adapters of {saved['base_model']}"
        wants = "trains all parameters" if lora is None else "trains LoRA adapters"
        raise CheckpointError(f"{where}: the checkpoint {has}, this run {wants}; set trainer.resume_mode=disable")
    if saved["base_model"] != lora["base_model"]:
        raise CheckpointError(
            f"{where}: its LoRA adapters belong to the base model {saved['base_model']}, not {lora['base_model']} "
            "(actor_rollout_ref.model.path); resume on that base or set trainer.resume_mode=disable"
        )
    changed = ", ".join(f"{k} {saved[k]} there, {lora.get(k)} here" for k in sorted(saved) if saved[k] != lora.get(k))
    raise CheckpointError(
        f"{where}: its LoRA adapters were built with other settings ({changed}); resume with the same "
        "actor_rollout_ref.model.lora settings or set trainer.resume_mode=disable"
    )


def check_same_data(path: Path, data: dict) -> None:
    """CheckpointError when the checkpoint's data position counts batches of another order than ``data``'s (the
    trainer state's ``data``: the training set's digest and that of the rows seen before the run): resuming would
    skip or repeat rows. A checkpoint saved before the training set was recorded is taken as it is."""
    state = read_trainer_state(path)
    saved = state.get("data")
    if saved is None:
        return
    parts = {"train_digest": "training set", "seen_sha256": "set of rows seen before the run (the start model's)"}
    changed = [(key, name) for key, name in parts.items() if saved.get(key) != data[key]]
    if not changed:
        return
    key, name = changed[0]
    position = state.get("data_position", state.get("step"))
    raise CheckpointError(
        f"{Path(path) / STATE_FILE}: its data position ({position} batches) counts in another {name} (digest "
        f"{str(saved.get(key))[:12]} there, {data[key][:12]} here), so resuming would skip or repeat rows; train "
        f"afresh (trainer.resume_mode=disable or a new trainer.default_local_dir), from its weights if you like: "
        f"`grpo export {path} DIR`, then actor_rollout_ref.model.path=DIR (the rows it drew come last)"
    )


def check_optimizer_layout(path: Path, tp: int, pp: int) -> str:
    """The checkpoint's optimizer format; CheckpointError when it holds each rank's shards of another TP/PP."""
    state = read_trainer_state(path)
    optimizer_format, saved = state.get("optimizer_format", "fully_reshardable"), state.get("optimizer_layout")
    if optimizer_format == "dp_reshardable" and saved not in (None, {"tp": tp, "pp": pp}):
        raise CheckpointError(
            f"{path}: its optimizer state is each rank's shards at TP={saved['tp']} PP={saved['pp']} (saved with "
            "actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=false), not loadable at TP="
            f"{tp} PP={pp}; resume at that TP/PP, or export the model (grpo export) and start a new run from it"
        )
    return optimizer_format


def contents_setting(checkpoint_cfg) -> tuple[frozenset, frozenset]:
    """(what to save, what to restore) from ``actor_rollout_ref.actor.checkpoint``."""
    save = frozenset(checkpoint_cfg.save_contents)
    load = checkpoint_cfg.load_contents
    return save, save if load is None else frozenset(load)


def saved_contents(state: dict) -> frozenset:
    """What a checkpoint holds, from its trainer state (everything, for one written before contents were recorded)."""
    return frozenset(state.get("contents", FULL_CONTENTS))


def load_actor_state(path: Path, actor, optimizer: bool = True) -> None:
    """Model (and, for a trainable actor, the optimizer unless ``optimizer`` is false) from a dist checkpoint,
    resharded to the actor's layout."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    optimizer = optimizer and actor.trainable
    optimizer_format = check_optimizer_layout(path, actor.s.layout.tp, actor.s.layout.pp) if optimizer else None
    try:
        sharded = actor.sharded_state_dict(is_loading=True, optimizer_format=optimizer_format, optimizer=optimizer)
        actor.load_sharded_state_dict(dist_checkpointing.load(sharded, str(path)))
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{path}: cannot load it into this model: {_failure_text(e)}") from e


class CheckpointManager:
    """Decides when to save, keeps the newest ``keep`` checkpoints, and finds the one to resume from. ``save_freq``
    and ``keep`` default to the schema's ``trainer.save_freq`` and ``trainer.max_actor_ckpt_to_keep``."""

    @defaults_from("trainer")
    def __init__(
        self,
        root: str | Path,
        save_freq: int = SETTING,
        keep: int | None = schema_default("trainer.max_actor_ckpt_to_keep"),
    ):
        self.root = Path(root)
        self.save_freq = save_freq
        self.keep = keep

    @classmethod
    def for_run(cls, trainer_cfg) -> "CheckpointManager":
        """The checkpoints of a run: ``trainer.default_local_dir/checkpoints``, every ``save_freq`` steps."""
        root = Path(trainer_cfg.default_local_dir) / "checkpoints"
        return cls(root, trainer_cfg.save_freq, keep=trainer_cfg.max_actor_ckpt_to_keep)

    def should_save(self, step: int, last_step: bool) -> bool:
        return last_step or (self.save_freq > 0 and step % self.save_freq == 0)

    def complete_checkpoints(self) -> list[Path]:
        """This run's complete checkpoints, oldest first: directories of ``root`` itself (a symbolic link, which
        could lead to another run's checkpoint, is none)."""
        if not self.root.is_dir():
            return []
        found = [
            p for p in self.root.iterdir() if _STEP_DIR.fullmatch(p.name) and not p.is_symlink() and is_complete(p)
        ]
        return sorted(found, key=lambda p: int(_STEP_DIR.fullmatch(p.name).group(1)))

    def latest(self) -> Path | None:
        """The newest complete checkpoint (not verified). Found by listing ``root``: the ``latest`` file is not
        trusted as a path (it could name another run's checkpoint, whose resume would overwrite this run's steps)."""
        complete = self.complete_checkpoints()
        return complete[-1] if complete else None

    def pointer(self) -> tuple[str | None, str | None]:
        """(the checkpoint name ``latest`` holds, None), or (None, why it names none of this directory's
        checkpoints: an absolute path, ``..``, a symbolic link); (None, None) when there is no ``latest``."""
        path = self.root / LATEST
        if path.is_symlink():
            return None, f"is a symbolic link (to {os.readlink(path)}), not a checkpoint's name"
        if not path.is_file():
            return None, None
        with open(path, "rb") as f:
            name = f.read(POINTER_BYTES).decode("utf-8", "replace").strip()
        if name.startswith("/"):
            return None, f"names {name!r}, an absolute path"
        if ".." in Path(name).parts:
            return None, f"names {name!r}, a path out of this directory (..)"
        if not _STEP_DIR.fullmatch(name):
            return None, f"names {name!r}, not a checkpoint's name (step_N)"
        if (self.root / name).is_symlink():
            return None, f"names {name}, a symbolic link (to {os.readlink(self.root / name)})"
        return name, None

    def _check_pointer(self, chosen: Path, skipped: set[str]) -> None:
        """One warning when ``latest`` does not name ``chosen``, the newest intact checkpoint (unless it names one
        already reported damaged): that one wins."""
        name, why = self.pointer()
        where = self.root / LATEST
        if why is not None:
            logger.warning("warning: %s %s; ignored: resuming from %s, this run's newest intact checkpoint",
                           where, why, chosen)  # fmt: skip
        elif name is not None and name != chosen.name and name not in skipped:
            logger.warning("warning: %s names %s, but %s is this run's newest intact checkpoint; resuming from it",
                           where, name, chosen)  # fmt: skip

    def resolve_resume(self, resume_mode: str) -> Path | None:
        """``auto``: the newest complete checkpoint (or none); ``disable``: none; else that path."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.newest_intact()
        path = Path(resume_mode)
        verify_checkpoint(path)  # raises with the reason when it cannot be used
        return path

    def newest_intact(self) -> Path | None:
        """The newest checkpoint that verifies; each damaged one newer than it gets one warning naming the file.
        None when there is none; CheckpointError when there are some and all are damaged (starting over would
        purge them: that takes trainer.resume_mode=disable)."""
        candidates, skipped = list(reversed(self.complete_checkpoints())), set()
        for path in candidates:
            try:
                verify_checkpoint(path)
            except CheckpointError as e:
                logger.warning("warning: %s; skipped, resuming from an older checkpoint if one is intact", e)
                skipped.add(path.name)
                continue
            self._check_pointer(path, skipped)
            return path
        if candidates:
            raise CheckpointError(
                f"no intact checkpoint in {self.root} (all {len(candidates)} damaged, see the warnings); "
                "set trainer.resume_mode=disable to start over"
            )
        return None

    def save(self, step: int, actor, trainer_state: dict, contents: frozenset = FULL_CONTENTS) -> Path:
        """Write ``step_N`` holding ``contents``; CheckpointSaveError (partial directory removed) when the
        filesystem fails."""
        final = self.root / f"step_{step:06d}"
        mine, anywhere = actor.non_finite_weights()
        if anywhere:  # a checkpoint of them would resume into the same failure: the newest one stays the last good
            previous = self.latest()
            raise NotFinite(
                f"not saving step {step}: weights hold NaN or infinity ({', '.join(mine[:3]) or 'on another rank'}"
                f"{', …' if len(mine) > 3 else ''}); the newest checkpoint is {previous or 'none'}"
            )
        partial = final.with_name(final.name + ".partial")
        try:
            self._write(partial, final, step, actor, trainer_state, contents | {"model"})
        except BaseException as e:  # torch's CheckpointException is a BaseException
            shutil.rmtree(partial, ignore_errors=True)
            if (cause := _write_failure(e)) is None:
                raise
            previous = self.latest()
            kept = f"the newest complete checkpoint is {previous}" if previous else "no earlier checkpoint exists"
            raise CheckpointSaveError(
                f"saving checkpoint {final} failed: {cause} ({_free_space(self.root)}); "
                f"the partial save was removed, {kept}"
            ) from e
        if _rank() == 0:  # once, not per rank
            logger.info("saved checkpoint %s", describe_checkpoint(final))
        return final

    def _write(self, partial: Path, final: Path, step: int, actor, trainer_state: dict, contents: frozenset) -> None:
        from megatron.core import dist_checkpointing

        from grpo_core.checkpoint.stream_save import StreamingSave

        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        _barrier()
        with_optimizer = "optimizer" in contents
        state_dict = actor.sharded_state_dict(optimizer=with_optimizer)
        dist_checkpointing.save(state_dict, str(partial), sharded_strategy=StreamingSave())
        if "extra" in contents:
            (partial / "rng").mkdir(exist_ok=True)
            states = {"cpu": torch.get_rng_state()}  # the static and HF engines sample from these
            if torch.cuda.is_available():
                states["cuda"] = torch.cuda.get_rng_state()
            torch.save(states, partial / "rng" / f"rank_{_rank()}.pt")
        if "hf_model" in contents:  # before the manifest, which then covers these files too
            from grpo_core.models.bridge import write_hf_model

            write_hf_model(actor.model, actor.shape, partial / HF_EXPORT, trainer_state)
        _barrier()  # every rank's files are on disk: the manifest covers them all
        if _rank() == 0:
            state = {
                **trainer_state,
                "step": step,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "contents": sorted(contents),
            }
            if "extra" in contents:
                state["lr_scheduler"] = actor.scheduler_state()
            if with_optimizer:
                state["optimizer_format"] = actor.optimizer_format
                state["optimizer_layout"] = {"tp": actor.s.layout.tp, "pp": actor.s.layout.pp}
            write_text_atomic(partial / STATE_FILE, json.dumps(state, indent=2))
            manifest.write_manifest(partial)
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            write_text_atomic(self.root / LATEST, final.name)
            self._purge()
        _barrier()

    def load(self, path: Path, actor, contents: frozenset = FULL_CONTENTS) -> dict:
        """Restore ``contents`` of what the checkpoint holds into the actor (any layout); return the trainer
        state saved with it."""
        state = read_trainer_state(path)
        saved = saved_contents(state)
        for missing in sorted(RESUMED_WITHOUT.keys() - (saved & contents)):  # the model is always loaded
            why = "load_contents leaves it out" if missing in saved else "save_contents did not hold it"
            logger.warning("resuming from %s without its %s (%s): %s", path, missing, why, RESUMED_WITHOUT[missing])
        load_actor_state(path, actor, optimizer="optimizer" in saved & contents)
        if "extra" in saved & contents:
            actor.load_scheduler_state(state.get("lr_scheduler", {}))
            rng_file = path / "rng" / f"rank_{_rank()}.pt"
            world = dist.get_world_size() if dist.is_initialized() else 1
            if state.get("world_size") == world and rng_file.is_file():
                states = torch.load(rng_file, weights_only=True)
                torch.set_rng_state(states["cpu"])
                if "cuda" in states and torch.cuda.is_available():
                    torch.cuda.set_rng_state(states["cuda"])
            else:
                logger.info("resuming at a different world size: RNG states start fresh")
        logger.info("resumed from %s (step %s)", path, state["step"])
        return state

    def _purge(self) -> None:
        if self.keep is None:
            return
        for old in self.complete_checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _write_failure(e: BaseException) -> str | None:
    """What the filesystem said, when ``e`` is a failed write: an OSError (ours, or wrapped by megatron's writer)
    or torch's CheckpointException (its writer processes report only their message). None for anything else."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}"
        if isinstance(e, CheckpointException):
            return _failure_text(e)
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


# torch's zip writer says only this when the OS wrote fewer bytes than asked (disk full, a file size limit)
_SHORT_WRITE = "unexpected pos"


def _failure_text(e: BaseException) -> str:
    """``e`` in one line; for torch's CheckpointException (whose text is a traceback) each rank's own message."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and (failures := getattr(e, "failures", None)):
        return "; ".join(f"rank {r}: {_writer_message(f)}" for r, f in sorted(failures.items()))
    return manifest.first_line(e)


def _writer_message(failure) -> str:
    """One writer process's failure (an exception, or megatron's (exception, frames) pair) in one line."""
    error = failure[0] if isinstance(failure, tuple) else failure
    text = manifest.first_line(error)
    return (
        f"a write came up short: the disk is full or a file size limit was hit ({text})"
        if _SHORT_WRITE in text
        else text
    )


def _free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 1e9:.1f} GB free there"
    except OSError:
        return "free space unknown"
