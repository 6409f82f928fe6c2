"""What /proc says of the processes a launch started: a process's children, whether it is stopped, and which
processes carry a given entry in their environment (torchrun starts each rank in a session of its own, so no
process group holds them all)."""

import os
from pathlib import Path


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat after "pid (comm)": state, ppid, ... (a command name may hold spaces and parentheses)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = _stat_fields(entry.name) if entry.name.isdigit() else []
        except OSError:
            continue
        if fields and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP: state ``T``; a debugger's trace stop, ``t``, is not)."""
    try:
        return _stat_fields(pid)[0] == "T"
    except (OSError, IndexError):
        return False


def pids_with(entry: str) -> list[int]:
    """Live processes but this one whose environment holds ``entry`` (``NAME=value``; zombies have none)."""
    marker = entry.encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            pids.append(int(proc.name))
    return pids
