"""Processes and mounts as the real (outermost) namespaces see them, from /proc: what the
simulated hosts of hosts.py need to find, kill and account for their processes."""
from __future__ import annotations

import os
import signal
from typing import Sequence


def pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (killed processes, for a moment)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[0] in (b"Z", b"X")
    except (OSError, ValueError, IndexError):
        return True


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for pid in pids():
        parent = parent_of(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_with_parent() -> None:
    """preexec_fn: Linux SIGKILLs this child when the test process dies (a killed pytest
    must not leave hosts behind)."""
    import ctypes
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG


def mounts() -> list[str]:
    """The real mount namespace's mounts as (mount point, type, source) lines, sorted."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            rows.append(" ".join([fields[4], fields[sep + 1], fields[sep + 2]]))
    return sorted(rows)
