"""Checkpoints that a crash can never half-write: megatron dist checkpoints plus the trainer's state.

Layout under ``root``::

    step_000010/          model + optimizer (megatron dist_checkpointing, reshardable), trainer_state.json,
                          rng/rank_<r>.pt
    step_000012.partial/  a save in progress (or killed): never loaded, removed by the next save
    latest                the name of the newest complete checkpoint, replaced atomically

All ranks write into ``step_N.partial``; after a barrier rank 0 writes ``trainer_state.json`` last and
renames the directory (atomic on POSIX), then points ``latest`` at it. A checkpoint is complete exactly
when its directory has no ``.partial`` suffix and holds ``trainer_state.json``.
"""

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(Exception):
    """A checkpoint asked for cannot be used; the message says why."""


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_complete(path: Path) -> bool:
    return path.is_dir() and _STEP_DIR.match(path.name) is not None and (path / STATE_FILE).is_file()


def read_trainer_state(path: Path) -> dict:
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {STATE_FILE}, or a .partial save)")
    try:
        return json.loads((path / STATE_FILE).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / STATE_FILE}:{e.lineno}: unreadable trainer state ({e.msg})") from None


def load_actor_state(path: Path, actor) -> None:
    """Model (and, for a trainable actor, optimizer) from a dist checkpoint, resharded to the actor's layout."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(actor.sharded_state_dict(is_loading=True), str(path))
    actor.load_sharded_state_dict(loaded)


class CheckpointManager:
    """Decides when to save, keeps the newest ``keep`` checkpoints, and finds the one to resume from."""

    def __init__(self, root: str | Path, save_freq: int = -1, keep: int | None = 2):
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
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if is_complete(p)]
        return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if pointer.is_file():
            candidate = self.root / pointer.read_text().strip()
            if is_complete(candidate):
                return candidate
        complete = self.complete_checkpoints()
        return complete[-1] if complete else None

    def resolve_resume(self, resume_mode: str) -> Path | None:
        """``auto``: the newest complete checkpoint (or none); ``disable``: none; else that path."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        path = Path(resume_mode)
        read_trainer_state(path)  # raises with the reason when it cannot be used
        return path

    def save(self, step: int, actor, trainer_state: dict) -> Path:
        from megatron.core import dist_checkpointing

        final = self.root / f"step_{step:06d}"
        partial = final.with_name(final.name + ".partial")
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        _barrier()
        dist_checkpointing.save(actor.sharded_state_dict(), str(partial))
        (partial / "rng").mkdir(exist_ok=True)
        torch.save({"cpu": torch.get_rng_state()}, partial / "rng" / f"rank_{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            state = {
                **trainer_state,
                "step": step,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "lr_scheduler": actor.scheduler_state(),
            }
            _atomic_write_text(partial / STATE_FILE, json.dumps(state, indent=2))
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            _atomic_write_text(self.root / "latest", final.name)
            self._purge()
        _barrier()
        logger.info("saved checkpoint %s", final)
        return final

    def load(self, path: Path, actor) -> dict:
        """Restore the actor (any layout) and return the trainer state saved with it."""
        state = read_trainer_state(path)
        load_actor_state(path, actor)
        actor.load_scheduler_state(state.get("lr_scheduler", {}))
        rng_file = path / "rng" / f"rank_{_rank()}.pt"
        world = dist.get_world_size() if dist.is_initialized() else 1
        if state.get("world_size") == world and rng_file.is_file():
            torch.set_rng_state(torch.load(rng_file, weights_only=True)["cpu"])
        else:
            logger.info("resuming at a different world size: RNG states start fresh")
        logger.info("resumed from %s (step %s)", path, state["step"])
        return state

    def _purge(self) -> None:
        if self.keep is None:
            return
        for old in self.complete_checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
