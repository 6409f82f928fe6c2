"""One digest for a data set's files: what a model version records of the data that trained or judged it, what a
checkpoint records of the training set its data position counts in, and what an evaluation cache is keyed on."""

import hashlib
from pathlib import Path


def files_digest(paths) -> str:
    """SHA-256 over each file's name, size and SHA-256, in the given order (a training set given as several files
    is another set when they are given in another order: its rows come in another order)."""
    lines = []
    for path in (Path(p).expanduser() for p in paths):
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        lines.append(f"{path.name}\0{path.stat().st_size}\0{digest}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()
