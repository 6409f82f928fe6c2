"""Whether a checkpoint directory is whole: its manifest, written last.

``manifest.json`` lists every file of a checkpoint (path relative to it, size, xxh3-128 hash), written by
rank 0 once every rank's shards are on disk and before the directory is published. Verifying reads each
listed file once (big reads, several files at a time: xxhash hashes at memory speed, so the disk decides
the time). Files added after publication (``hf/``, an export) are not listed and not checked.

A manifest proves a checkpoint is whole, not that it is safe: whoever can change a file can rewrite its
manifest. What it holds is checked with no manifest at all (contents.py).
"""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from grpo_core.records.checkpoint import CheckpointManifest
from grpo_core.records.reader import RecordError, read_json

MANIFEST_FILE = "manifest.json"
HASH_NAME = "xxh3_128"
READ_BYTES = 16 << 20
THREADS = min(8, os.cpu_count() or 1)


class DamagedFile(Exception):
    """One file of a checkpoint fails a check: ``str()`` names it and says how; ``kind`` is ``damaged`` (missing,
    cut, changed), ``unsafe`` (holds what could run code) or ``non-finite`` (weights that are not numbers)."""

    def __init__(self, path: Path, reason: str, kind: str = "damaged"):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.kind = path, reason, kind


@dataclass(frozen=True)
class Verified:
    files: int
    bytes: int
    seconds: float  # reading and hashing the files
    manifest: bool  # False: a checkpoint from before manifests, checked as far as it can be
    contents_seconds: float = 0.0  # checking what the files hold (contents.py)

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
    """The manifest (records/checkpoint.py: files inside ``root``, sizes and hashes), None when there is none;
    DamagedFile naming the field when it is not one."""
    path = root / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = read_json(path, CheckpointManifest)
    except RecordError as e:
        raise DamagedFile(path, e.reason) from None
    if manifest.hash != HASH_NAME:
        raise DamagedFile(path, f"field 'hash': expected {HASH_NAME!r}, got {manifest.hash!r}")
    return manifest.model_dump(exclude_unset=True)


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
    if manifest is None:
        total = sum((root / rel).stat().st_size for rel in _files(root))
    return Verified(
        files=len(manifest["files"]) if manifest else len(_files(root)),
        bytes=total,
        seconds=time.perf_counter() - start,
        manifest=manifest is not None,
    )
