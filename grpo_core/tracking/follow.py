"""Follow a training run's metrics.jsonl from another process: one line per step as the step ends.

What ``grpo pipeline`` shows while its training task runs (the ranks' own output goes to the launch log).
"""

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from grpo_core.polling import polling

# (metric, label, format) of a step line, in order, when the step has it
STEP_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/accuracy", "accuracy", "{:.3f}"),
    ("val/accuracy", "val accuracy", "{:.3f}"),
    ("perf/throughput", "tokens/s", "{:.1f}"),
    ("timing/step", "step time", "{:.1f} s"),
)


def step_line(row: dict, total: int | None) -> str:
    """``step 3/10: reward 0.412  accuracy 0.375  tokens/s 812.4  step time 9.5 s`` (``step 3:`` without a total)"""
    fields = [f"{label} {fmt.format(row[key])}" for key, label, fmt in STEP_FIELDS if key in row]
    return f"step {row['step']}{f'/{total}' if total else ''}: " + "  ".join(fields)


def new_rows(path: Path, offset: int) -> tuple[list[dict], int]:
    """The complete JSON lines after byte ``offset``, and the offset after the last of them."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:end].decode().splitlines() if line.strip()]
    return rows, offset + end


@contextmanager
def following(path: str | Path, on_row: Callable[[dict], None], poll_s: float = 1.0) -> Iterator[None]:
    """While the block runs, call ``on_row`` for each row appended to ``path`` (rows already there are not
    shown); the rows written before the block ends are shown when it ends. A file replaced meanwhile (the
    trainer rewrites it without an earlier run's later steps) is read from its start."""
    path = Path(path)

    def identity() -> int | None:
        return path.stat().st_ino if path.is_file() else None

    file, offset = identity(), path.stat().st_size if path.is_file() else 0

    def read(_last: bool) -> None:
        nonlocal file, offset
        if (now := identity()) != file:
            file, offset = now, 0
        rows, offset = new_rows(path, offset)
        for row in rows:
            on_row(row)

    with polling(read, poll_s, "metrics-follow"):
        yield
