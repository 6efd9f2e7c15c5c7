"""Cross-memory attach: one kernel copy between this process's memory and a peer process's.

Linux's ``process_vm_readv`` / ``process_vm_writev`` copy straight between two address spaces,
the way MPI libraries (Open MPI's vader, MPICH's CMA path) move large messages within a node:
no shared segment in between, so a buffer crosses memory once instead of being packed into a
shared window by its owner and read out of it by the peer.  The kernel allows it where ptrace
would be allowed (same user; with Yama's ``ptrace_scope`` 1 only from a process the target
declared with ``prctl(PR_SET_PTRACER)`` or a descendant of it; ``CAP_SYS_PTRACE``) and where no
seccomp filter forbids the two calls; :func:`load` only finds the calls, whether a given peer
may be reached is found out by trying (see ``direct_allreduce``).

There is no maintained Python binding of these calls, so this is the thin ctypes one: two C
structures and three foreign functions from the C library that Python itself is linked against.
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

YAMA_SCOPE_FILE = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61   # "Yama": prctl option of <linux/prctl.h>


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class CrossMemory:
    """Copies of contiguous byte ranges between this process and process ``pid``.

    Not thread-safe: one instance per thread (it reuses two ``iovec`` structures, so that a
    copy costs a foreign call and no allocation).  ctypes releases the GIL during the call."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._readv = libc.process_vm_readv
        self._writev = libc.process_vm_writev
        for fn in (self._readv, self._writev):
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                           ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        self._local = _IoVec()
        self._remote = _IoVec()
        self._local_ref = ctypes.byref(self._local)
        self._remote_ref = ctypes.byref(self._remote)

    def read(self, pid: int, address: int, dst: np.ndarray) -> None:
        """Fill the contiguous array ``dst`` with the bytes at ``address`` in process ``pid``."""
        self._call(self._readv, "read", pid, address, dst)

    def write(self, pid: int, address: int, src: np.ndarray) -> None:
        """Write the contiguous array ``src`` to ``address`` in process ``pid``."""
        self._call(self._writev, "write", pid, address, src)

    def _call(self, fn, what: str, pid: int, address: int, local: np.ndarray) -> None:
        nbytes = local.nbytes
        if nbytes == 0:
            return
        self._local.iov_base = local.ctypes.data
        self._local.iov_len = nbytes
        self._remote.iov_base = address
        self._remote.iov_len = nbytes
        done = fn(pid, self._local_ref, 1, self._remote_ref, 1, 0)
        if done != nbytes:   # -1 with errno, or a partial copy (a fault in the remote range)
            err = ctypes.get_errno() if done < 0 else 0
            reason = os.strerror(err) if err else f"only {done} of {nbytes} bytes copied"
            raise OSError(err or None,
                          f"process_vm_{what}v of {nbytes} bytes at 0x{address:x} in process "
                          f"{pid} failed: {reason}")


def load() -> CrossMemory | None:
    """The two calls, or None where they do not exist (not Linux, or a C library without
    them: glibc has them since 2.15)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_readv   # noqa: B018 - the lookup is the check
        libc.process_vm_writev  # noqa: B018
    except (OSError, AttributeError):
        return None
    return CrossMemory(libc)


def yama_scope(path: str | None = None) -> int | None:
    """Yama's ``ptrace_scope`` (0: same user suffices; 1: only declared tracers and ancestors;
    2: only with ``CAP_SYS_PTRACE``; 3: never), or None where Yama is absent."""
    try:
        with open(path or YAMA_SCOPE_FILE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def allow_tracer(pid: int) -> None:
    """Let process ``pid`` and its descendants reach this process's memory under Yama's
    ``ptrace_scope`` 1 (``prctl(PR_SET_PTRACER, pid)``; 0 withdraws it).  Raises OSError where
    it is refused (EINVAL: no Yama in this kernel)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.restype = ctypes.c_int
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(_PR_SET_PTRACER, pid, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PTRACER, {pid}) failed: {os.strerror(err)}")


def ancestors(pid: int | None = None, limit: int = 64) -> list[int]:
    """The ancestors of process ``pid`` (default: this one), nearest first, without process 1
    (from ``/proc``; shorter if one ends while being read)."""
    chain: list[int] = []
    current = os.getppid() if pid is None else _parent(pid)
    while current is not None and current > 1 and len(chain) < limit:
        chain.append(current)
        current = _parent(current)
    return chain


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # "pid (name) state ppid ...": the name may hold spaces and parentheses
        return int(stat[stat.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):   # gone, or no /proc as Linux writes it
        return None


def nearest_common_ancestor(lineages: list[list[int] | None]) -> int | None:
    """The first process of the first lineage that is in every lineage (each nearest first;
    ``None`` entries are ignored), or None where there is none."""
    chains = [chain for chain in lineages if chain is not None]
    if not chains:
        return None
    others = [set(chain) for chain in chains[1:]]
    return next((pid for pid in chains[0] if all(pid in seen for seen in others)), None)
