"""What a checkpoint holds, checked before anything loads it: no code, and weights that are numbers.

A megatron dist checkpoint carries pickles in three places: torch.distributed.checkpoint's ``.metadata``
index, megatron's ``common.pt``, and byte items inside the ``*.distcp`` shards (megatron's ShardedObjects:
each layer's ``_extra_state``, the optimizer's per-rank state, megatron 0.19's common state), which torch's
load planner unpickles with ``weights_only=False``. Whoever can write a checkpoint could make any of them run
code in the process that loads it. Two guards, both needed:

- ``check_contents``, run by every verify and so before every load: ``.metadata`` is read by an unpickler that
  knows only torch's checkpoint classes; ``common.pt`` and every byte item must load with
  ``torch.load(weights_only=True)``; every shard is as long as the metadata says; the model's tensors are
  finite (a NaN checkpoint would resume into the same crash). It needs no manifest, so it covers copies and
  checkpoints written before manifests.
- torch's own switch, ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1``, which importing grpo_core sets (grpo_core/__init__.py),
  makes every ``torch.load`` of the process weights-only whatever its caller asked (megatron's loaders and
  torch's planner included), so a byte item changed between the check and the load is refused too. torch's own
  read of ``.metadata`` (plain ``pickle``, which that switch does not reach) goes through the check's unpickler
  once this module is imported (``guard_torch_metadata_reads``), so a ``.metadata`` swapped after its check is
  refused as well.
"""

import io
import pickle
import warnings
from collections import defaultdict
from pathlib import Path

import torch

from grpo_core.checkpoint.manifest import DamagedFile, first_line
from grpo_core.numerics import finite_each

DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's index of every item's bytes
COMMON_FILE = "common.pt"  # megatron's non-tensor state (megatron 0.16; 0.19 keeps it as a byte item)
OPTIMIZER_PREFIX = "optimizer."  # the items of Adam's state; the rest are the model's


_PLAIN_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # torch's FileSystemWriter records the directory it wrote to
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's metadata and refuses every other global (code a pickle could run)."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type) or name == "_MEM_FORMAT_ENCODING":
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _PLAIN_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


class _GuardedPickle:
    """Stands in for the ``pickle`` module of torch.distributed.checkpoint's filesystem reader: its one load (the
    ``.metadata`` index) through ``_MetadataUnpickler``; everything else (the writer's dump) is pickle's own."""

    def __getattr__(self, name: str):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        return _MetadataUnpickler(file).load()


def guard_torch_metadata_reads() -> None:
    """Make torch's read of a checkpoint's ``.metadata`` refuse every global but its own classes, as the check does."""
    from torch.distributed.checkpoint import filesystem

    filesystem.pickle = _GuardedPickle()


guard_torch_metadata_reads()


def read_metadata(root: Path):
    """The checkpoint's torch.distributed.checkpoint Metadata, read without running code; DamagedFile if it is not."""
    path = root / DIST_METADATA
    if not path.is_file():
        raise DamagedFile(path, "missing: not a megatron dist checkpoint, or an incomplete copy")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        metadata.storage_data.values()  # noqa: B018  (an object of another shape fails here)
    except pickle.UnpicklingError as e:
        raise DamagedFile(path, f"not torch checkpoint metadata ({e})", kind="unsafe") from None
    except Exception as e:
        raise DamagedFile(path, f"not torch checkpoint metadata ({first_line(e)})") from None
    return metadata


def check_contents(root: str | Path) -> None:
    """Raise DamagedFile (kind damaged, unsafe or non-finite) for the first file that fails a check of the
    module docstring. Reads the byte items and the model's tensors, not Adam's state (several times their size)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    root = Path(root)
    metadata = read_metadata(root)
    items: dict[str, list] = defaultdict(list)  # shard file -> (name, is a byte item, offset, length)
    for index, info in metadata.storage_data.items():
        is_bytes = isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
        items[info.relative_path].append((index.fqn, is_bytes, info.offset, info.length))
    for rel, entries in sorted(items.items()):
        shard = root / rel
        if not shard.is_file():
            raise DamagedFile(shard, "missing (the checkpoint's metadata lists it)")
        needed = max(offset + length for _, _, offset, length in entries)
        if (size := shard.stat().st_size) < needed:
            raise DamagedFile(shard, f"truncated: {size} bytes, the metadata needs {needed}")
    for rel, entries in sorted(items.items()):
        wanted = [e for e in entries if e[1] or not e[0].startswith(OPTIMIZER_PREFIX)]
        with open(root / rel, "rb") as f:
            for name, is_bytes, offset, length in sorted(wanted, key=lambda e: e[2]):
                f.seek(offset)
                value = _plain(f.read(length), root / rel, f"item {name}")
                if not is_bytes and (bad := _non_finite(value)):
                    raise DamagedFile(
                        root / rel,
                        f"item {name} holds {bad} NaN or infinite value(s): the run had diverged when it was saved",
                        kind="non-finite",
                    )
    common = root / COMMON_FILE
    if common.is_file():
        _plain(common.read_bytes(), common, "")


def _plain(data: bytes, path: Path, what: str):
    """``data`` loaded with ``torch.load(weights_only=True)``; DamagedFile (unsafe) naming ``what`` if it holds
    anything but tensors, numbers and containers."""
    try:
        with warnings.catch_warnings():  # its note on the pickle protocol would come before our one line
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = f"refused: not plain tensors and numbers ({_weights_only_reason(e)})"
        raise DamagedFile(path, f"{what}: {reason}" if what else reason, kind="unsafe") from None
    except Exception as e:
        raise DamagedFile(path, f"{what + ': ' if what else ''}unreadable ({first_line(e)})") from None


def _non_finite(value) -> int:
    """How many of a tensor's values are NaN or infinite (0 for anything else; counted only when there are some)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or finite_each([value]).item():
        return 0
    return int((~torch.isfinite(value)).sum())


def _weights_only_reason(e: BaseException) -> str:
    """torch.load(weights_only=True)'s own reason, which its long message gives after "WeightsUnpickler error:"."""
    text = str(e)
    _, found, rest = text.partition("WeightsUnpickler error:")
    reason = next((line.strip() for line in rest.splitlines() if line.strip()), "") if found else ""
    return f"torch.load(weights_only=True): {reason or first_line(e)}"
