"""The local copies the registry serves (registry.py), and what each is checked against before each use.

``model/`` holds a version's files (a model, or a LoRA adapter). They are checked against the SHA-256 digest that
the tracking server recorded at registration (``grpo.model_sha256``: ``file_digests``), out of reach of whoever
can write the artifact store or the cache.

A LoRA version's ``merged/`` (its base with the adapter merged in) is made here, so no server records it. The
merge writes two files into it before the directory is renamed into place: what it was made from
(``merge_inputs.json``: the adapter's digest, the base's name) and a manifest of every file (checkpoint/manifest.py:
sizes and xxh3 hashes, cheap to check). They prove the copy is what the merge wrote; they are in the cache, so
whoever can write the cache can rewrite them too (SECURITY.md).
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

from grpo_core.checkpoint import manifest
from grpo_core.checkpoint.manifest import DamagedFile
from grpo_core.data.lineage import file_sha256

INPUTS_FILE = "merge_inputs.json"
INPUTS_BYTES = 64 << 10  # a record of two names: anything larger is not one


def file_digests(directory: Path) -> dict[str, str]:
    """Each file under ``directory`` (its relative path) -> its line of the version's digest (path, size, SHA-256),
    in the order the digest takes them."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): f"{p.relative_to(directory)}\0{p.stat().st_size}\0{file_sha256(p)}\n"
            for p in files}  # fmt: skip


def digest_of(lines: dict[str, str]) -> str:
    """The digest registration records (``grpo.model_sha256``) of files whose lines ``file_digests`` gave."""
    return hashlib.sha256("".join(lines.values()).encode()).hexdigest()


def changed_files(found: dict[str, str], registered: dict[str, str]) -> str:
    """How a copy (``file_digests``) differs from the registered files, for one line: ``model.safetensors changed``."""
    parts = [f"{rel} changed" for rel in found.keys() & registered.keys() if found[rel] != registered[rel]]
    parts += [f"{rel} added" for rel in found.keys() - registered.keys()]
    parts += [f"{rel} missing" for rel in registered.keys() - found.keys()]
    parts.sort()
    return ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")


def discard(directory: Path) -> None:
    """Take ``directory`` out of use at once (renamed aside), then remove it."""
    if not directory.exists():
        return
    gone = directory.with_name(f"{directory.name}.discarded-{os.getpid()}")
    shutil.rmtree(gone, ignore_errors=True)
    directory.rename(gone)
    shutil.rmtree(gone, ignore_errors=True)


def seal_merged(build: Path, inputs: dict[str, str]) -> None:
    """Record in ``build`` (a merge's output, not yet in place) what it was made from, then every file it holds."""
    (build / INPUTS_FILE).write_text(json.dumps(inputs, sort_keys=True))
    manifest.write_manifest(build)


def merged_problem(merged: Path, inputs: dict[str, str]) -> str | None:
    """None when ``merged`` is what a merge of ``inputs`` wrote (every file as the merge's manifest lists it, and
    no other), else why not, naming the file."""
    record = merged / manifest.MANIFEST_FILE
    if not merged.is_dir():
        return f"{merged}: not merged yet"
    try:
        if (written := manifest.read_manifest(merged)) is None:
            return f"{record}: missing, so what the merge wrote is unknown (merged before it was recorded)"
        listed = set(written["files"]) | {manifest.MANIFEST_FILE}
        if INPUTS_FILE not in listed:
            return f"{record}: lists no {INPUTS_FILE}, so what the merge was made from is unknown"
        manifest.verify(merged)
        if extra := sorted({str(p.relative_to(merged)) for p in merged.rglob("*") if p.is_file()} - listed):
            return f"{merged / extra[0]}: not written by the merge"
        with open(merged / INPUTS_FILE, "rb") as f:
            made_from = json.loads(f.read(INPUTS_BYTES))
    except DamagedFile as e:
        return str(e)
    except (OSError, ValueError) as e:
        return f"{merged}: unreadable ({manifest.first_line(e)})"
    if made_from != inputs:
        return f"{merged / INPUTS_FILE}: merged from another adapter or base ({made_from!r:.200})"
    return None


def publish(build: Path, merged: Path, inputs: dict[str, str]) -> None:
    """``build`` (sealed) in place of ``merged``, which is discarded first; a concurrent merge that got there
    first is kept when it checks out."""
    discard(merged)
    try:
        build.rename(merged)
    except OSError:
        if merged_problem(merged, inputs) is not None:
            raise
        shutil.rmtree(build, ignore_errors=True)
