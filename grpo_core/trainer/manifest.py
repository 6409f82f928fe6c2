"""Whether a checkpoint directory is whole: its manifest, written last, and the checks that need none.

``manifest.json`` lists every file of a checkpoint (path relative to it, size, xxh3-128 hash), written by
rank 0 once every rank's shards are on disk and before the directory is published. Verifying reads each
listed file once (big reads, several files at a time: xxhash hashes at memory speed, so the disk decides
the time). Files added after publication (``hf/``, an export) are not listed and not checked.

Checks that need no manifest, run on every checkpoint (and all that can be checked on one written before
manifests existed): the files megatron's loader opens are there; torch's ``.metadata`` unpickles with
nothing but torch's checkpoint classes (megatron itself unpickles it with plain ``pickle``); every shard
file is as long as the metadata says; ``common.pt`` loads with ``weights_only=True``.
"""

import io
import json
import os
import pickle
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

MANIFEST_FILE = "manifest.json"
HASH_NAME = "xxh3_128"
READ_BYTES = 16 << 20
THREADS = min(8, os.cpu_count() or 1)
DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's index of every tensor's bytes
COMMON_FILE = "common.pt"  # megatron's non-tensor state


class DamagedFile(Exception):
    """One file of a checkpoint is missing, cut, changed or untrusted: ``str()`` names it and says how."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class Verified:
    files: int
    bytes: int
    seconds: float
    manifest: bool  # False: a checkpoint from before manifests, checked as far as it can be

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)


def file_hash(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(READ_BYTES)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name not in (MANIFEST_FILE,))


def _hash_all(root: Path, rels: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(THREADS) as pool:
        return dict(zip(rels, pool.map(lambda rel: file_hash(root / rel), rels), strict=True))


def write_manifest(root: Path) -> dict:
    """List and hash every file under ``root``; ``manifest.json`` is written atomically (tmp, fsync, rename)."""
    rels = _files(root)
    hashes = _hash_all(root, rels)
    manifest = {
        "hash": HASH_NAME,
        "files": {rel: {"size": (root / rel).stat().st_size, "hash": hashes[rel]} for rel in rels},
    }
    tmp = root / (MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST_FILE)
    return manifest


def read_manifest(root: Path) -> dict | None:
    path = root / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("hash") != HASH_NAME or not all({"size", "hash"} <= set(v) for v in files.values()):
            raise ValueError(f"not a {HASH_NAME} manifest")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedFile(path, f"unreadable manifest ({e})") from None
    return manifest


_PLAIN_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # torch's FileSystemWriter records the directory it wrote to
}


class _TorchCheckpointClasses(pickle.Unpickler):
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


def _check_structure(root: Path) -> None:
    """The checks any megatron dist checkpoint passes: see the module docstring."""
    meta_path = root / DIST_METADATA
    if not meta_path.is_file():
        raise DamagedFile(meta_path, "missing: not a megatron dist checkpoint, or an incomplete copy")
    try:
        metadata = _TorchCheckpointClasses(io.BytesIO(meta_path.read_bytes())).load()
        extents: dict[str, int] = {}
        for info in metadata.storage_data.values():
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:
        raise DamagedFile(meta_path, f"not torch checkpoint metadata ({first_line(e)})") from None
    for rel, needed in sorted(extents.items()):
        shard = root / rel
        if not shard.is_file():
            raise DamagedFile(shard, "missing (the checkpoint's metadata lists it)")
        if (size := shard.stat().st_size) < needed:
            raise DamagedFile(shard, f"truncated: {size} bytes, the metadata needs {needed}")
    common = root / COMMON_FILE
    if common.is_file():
        try:
            with warnings.catch_warnings():  # its note on the pickle protocol would come before our one line
                warnings.simplefilter("ignore")
                torch.load(common, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise DamagedFile(common, f"refused: not plain tensors and numbers ({_weights_only_reason(e)})") from None
        except Exception as e:
            raise DamagedFile(common, f"unreadable ({first_line(e)})") from None


def _weights_only_reason(e: BaseException) -> str:
    """torch.load(weights_only=True)'s own reason, which its long message gives after "WeightsUnpickler error:"."""
    text = str(e)
    _, found, rest = text.partition("WeightsUnpickler error:")
    reason = next((line.strip() for line in rest.splitlines() if line.strip()), "") if found else ""
    return f"torch.load(weights_only=True): {reason or first_line(e)}"


def first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:200]
    return type(e).__name__


def verify(root: str | Path) -> Verified:
    """Raises DamagedFile naming the first bad file; else how much was read and how fast."""
    root = Path(root)
    start = time.perf_counter()
    manifest = read_manifest(root)
    total = 0
    if manifest is not None:
        files = manifest["files"]
        for rel, entry in files.items():
            path = root / rel
            if not path.is_file():
                raise DamagedFile(path, "missing (listed in the manifest)")
            if (size := path.stat().st_size) != entry["size"]:
                raise DamagedFile(path, f"{size} bytes, the manifest says {entry['size']} (cut or replaced)")
            total += size
        hashes = _hash_all(root, list(files))
        for rel, entry in files.items():
            if hashes[rel] != entry["hash"]:
                raise DamagedFile(root / rel, "content differs from the manifest (hash mismatch)")
    _check_structure(root)
    if manifest is None:
        total = sum((root / rel).stat().st_size for rel in _files(root))
    return Verified(
        files=len(manifest["files"]) if manifest else len(_files(root)),
        bytes=total,
        seconds=time.perf_counter() - start,
        manifest=manifest is not None,
    )
