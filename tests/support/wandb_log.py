"""Read an offline W&B run file (``run-<id>.wandb``) back: wandb (0.2x+) no longer ships a Python reader, but
the file is LevelDB's log format (a 7-byte ``:W&B`` header, then 32 KiB blocks of checksummed chunks) holding
wandb's own ``Record`` protobufs, which its package does ship."""

import struct
from collections.abc import Iterator
from pathlib import Path

FILE_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
CHUNK_HEADER = 7  # crc32 (4), length (2), chunk type (1)
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, parts = FILE_HEADER, []
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if left < CHUNK_HEADER or (length == 0 and kind == 0):  # block trailer padding
            pos += left
            continue
        parts.append(data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length])
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def read_run(path: Path) -> dict:
    """{"project", "name", "config": {key: value}, "history": [{"_step": n, metric: value, ...}]}, one history
    row per step, in step order."""
    import json

    run: dict = {"config": {}, "history": []}
    by_step: dict[int, dict] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["project"], run["name"] = record.run.project, record.run.display_name
            run["config"] |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "config":
            run["config"] |= {u.key: json.loads(u.value_json) for u in record.config.update}
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            by_step.setdefault(row.get("_step", record.history.step.num), {}).update(row)  # a step may come in parts
    run["history"] = [by_step[step] for step in sorted(by_step)]
    return run
