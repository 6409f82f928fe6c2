"""``grpo tracking sync RUN_DIR``: send the MLflow calls a run could not send (its pending file) to a server.

The pending file is append-only JSON lines, one call each, in the order they were made (mlflow_run.py
writes it). Beside it, ``mlflow_pending.sent`` holds how many of its first lines are on the server: it is
rewritten (atomically) after every call sent, so a second sync, or one after an interruption, sends each
call once. A lock on that file keeps two syncs of one run from sending the same calls.

Simplification: a sync killed between a call reaching the server and the count being written sends that
one call again next time (a metric logged twice at the same step and timestamp).
"""

import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.config.secrets import MASK, hide_url_passwords
from grpo_core.tracking.mlflow_run import REJECTED, MlflowRun

logger = logging.getLogger(__name__)
PENDING_FILE = "mlflow_pending.jsonl"
SENT_FILE = "mlflow_pending.sent"
ENTITIES = {"metrics": "Metric", "params": "Param", "tags": "RunTag"}  # log_batch's lists


class SyncError(Exception):
    """The pending file cannot be read (not the server's fault): one line for the user."""


@dataclass
class SyncResult:
    pending_file: Path
    total: int  # calls in the file
    already: int  # on the server before this sync
    sent: int  # by this sync
    dropped: list[str]  # calls the server refused or whose file is gone (said why)
    run_ids: list[str]
    error: str = ""  # why the sync stopped early (the server did not answer)

    @property
    def complete(self) -> bool:
        return not self.error


def pending_path(run_dir: str | Path) -> Path:
    """A run directory's pending file (or the file itself when given one)."""
    path = Path(run_dir)
    return path if path.is_file() else path / PENDING_FILE


def read_records(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise SyncError(f"{path}:{number} is not a JSON line; the file was damaged") from None
        if not isinstance(record, dict) or not {"run_id", "method", "args"} <= record.keys():
            raise SyncError(f"{path}:{number} is not a pending MLflow call (needs run_id, method, args)")
        records.append(record)
    return records


def call_arguments(method: str, args: dict[str, Any]) -> dict[str, Any]:
    """A recorded call's arguments as the client takes them (log_batch's dicts back into entities)."""
    if method != "log_batch":
        return dict(args)
    import mlflow.entities

    out = {}
    for name, items in args.items():
        entity = getattr(mlflow.entities, ENTITIES[name])
        out[name] = [entity(**item) for item in items]
    return out


def missing_file(method: str, args: dict[str, Any]) -> str | None:
    path = args.get("local_path") or args.get("local_dir")
    return path if method in ("log_artifact", "log_artifacts") and not Path(path).exists() else None


def read_sent(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except FileNotFoundError:
        return 0
    except ValueError:
        raise SyncError(f"{path} is not a count of calls sent; delete it only if nothing was synced") from None


def write_sent(path: Path, count: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{count}\n")
    os.replace(tmp, path)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SyncError(f"another sync of {path.parent} is running") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sync_pending(run_dir: str | Path, tracking_uri: str | None = None) -> SyncResult:
    """Send the calls of ``run_dir``'s pending file that are not on the server yet, in order; stop at the
    first one the server does not answer (the rest stay pending). ``tracking_uri`` overrides the recorded one."""
    path = pending_path(run_dir)
    if not path.is_file():
        raise SyncError(f"{path} does not exist: nothing is pending for {run_dir}")
    sent_file = path.with_name(SENT_FILE)
    with locked(path.with_name(SENT_FILE + ".lock")):
        records = read_records(path)
        already = min(read_sent(sent_file), len(records))
        hidden = [r["tracking_uri"] for r in records[already:] if f":{MASK}@" in r.get("tracking_uri", "")]
        if hidden and tracking_uri is None:  # a database URL's password is never written to the pending file
            raise SyncError(
                f"{path} names MLflow at {hidden[0]}, whose password is not written down; give the URI: "
                f"grpo tracking sync {run_dir} --tracking-uri URI"
            )
        result = SyncResult(path, len(records), already, 0, [], [])
        runs: dict[tuple[str, str], MlflowRun] = {}
        for index in range(already, len(records)):
            record = records[index]
            method, args = record["method"], record["args"]
            uri = tracking_uri or record.get("tracking_uri") or "sqlite:///mlflow.db"
            run = runs.setdefault((uri, record["run_id"]), MlflowRun(uri, record["run_id"]))
            if gone := missing_file(method, args):
                result.dropped.append(f"{method} of {gone}: the file no longer exists")
            else:
                try:
                    run.call(method, call_arguments(method, args))
                except Exception as e:  # noqa: BLE001  (the server's answer decides: drop, or stop here)
                    if getattr(e, "error_code", None) not in REJECTED:
                        where = hide_url_passwords(uri)
                        result.error = f"MLflow at {where} did not take call {index + 1} ({method}): {_first_line(e)}"
                        break
                    result.dropped.append(f"{method}: refused by the server: {_first_line(e)}")
            if run.run_id not in result.run_ids:
                result.run_ids.append(run.run_id)
            result.sent += 1
            write_sent(sent_file, index + 1)
    return result


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
