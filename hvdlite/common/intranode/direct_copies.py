"""Intra-node allreduce of one large tensor by direct copies between the ranks' own memory.

Where the kernel lets ranks of one node reach each other's memory (cross-memory attach, see
:mod:`cma`), a single large allreduce needs no shared segment at all:

1. every rank posts the addresses of its input and output (and its prescale factor) in one tiny
   non-blocking allgather;
2. rank ``p`` owns share ``p`` of the elements.  For each 1 MiB chunk of it, it reads the
   peers' inputs straight into a scratch buffer, combines them with its own input in its output
   (own value first, then the peers in rank order: the order the shared window uses too, so the
   result does not depend on the path), applies the postscale, and writes the finished chunk
   straight into every peer's output;
3. a second tiny allgather (each rank's "all my copies succeeded") ends the operation: after
   it, every peer has finished reading this rank's input and writing its output.

Across hosts (the hierarchical path's :class:`Crossing`), the finished chunks of a share are
exchanged with the other hosts piece by piece before they are written to the peers: a piece
starts crossing once it is reduced, and is written out once it is back, while the next ones
are being reduced.  Nothing else changes within the host (the peers read only inputs, and look
at their outputs only after the last allgather).

Each element is reduced by exactly one rank, so results are bitwise identical everywhere.  In
place, rank ``p`` both reads and writes only share ``p`` of a peer's buffer, and the owner
touches only its own share, so no copy can see a half-updated value.  Against the shared window
(each rank publishes its peers' shares, then copies the results out again) every element
crosses memory about half as often: at 2 ranks a 16 MiB in-place Sum measured 3.5-4.3 ms
against 5.6-7.1 ms through the window.

Whether the copies are possible is decided once, collectively, by trying them (a process may
not reach another where Yama's ``ptrace_scope`` is 2 or more, where it is 1 and the target has
not let the reader in, or where a seccomp filter blocks the calls): every rank makes the same
collective calls in the same order, and where any rank cannot reach any peer, every rank keeps
using the shared window or MPI.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Callable, Protocol

import numpy as np

from hvdlite.common.dtypes import scale_into
from hvdlite.common.errors import HvdliteError
from hvdlite.common.intranode import cma
from hvdlite.common.intranode.shared_window import SharedWindow, all_on_one_node
from hvdlite.common.runtime.waiting import PEER_SPIN_SECONDS, wait_until

log = logging.getLogger("hvdlite")


class Crossing(Protocol):
    """The exchange of this rank's share with other hosts, piece by piece (the hierarchical
    path's): ``pieces`` are ascending element ranges covering the share; ``start(i, view)``
    starts piece ``i``'s exchange, in place, once it is reduced here; ``done(i)`` tests it (and
    moves every started one along); ``finish(i)`` waits for it."""

    pieces: list[tuple[int, int]]

    def start(self, index: int, view: np.ndarray) -> None: ...

    def done(self, index: int) -> bool: ...

    def finish(self, index: int) -> None: ...

# Smaller single tensors keep the window (or MPI): through the engine at 2 ranks, in place
# this path led from 1 MiB (0.47 against 0.53 ms), but out of place it trailed up to 2 MiB
# (1 MiB 0.73 against 0.66 ms, 2 MiB 1.18 against 1.11) and led from 4 MiB; whether a tensor is
# in place may differ between ranks, so only its size can choose.
MIN_BYTES = 2 << 20
# One step of the copies: each costs two system calls whose fixed cost (~6 us, plus pinning
# every page) favours big chunks, while combining favours chunks that stay in cache.  At 2 ranks
# in place, 16 MiB took 3.4-3.8 ms with 1 MiB chunks against 4.4-4.8 ms with 256 KiB on an AMD
# EPYC (Zen 3, 512 KiB L2), and MLP training steps were 0.7-3.5 ms shorter in 5 of 6
# interleaved jobs; an earlier Intel Xeon measured 128-512 KiB alike and 1 MiB slower (see
# benchmarks/HISTORY.md).
_CHUNK_BYTES = 1 << 20
_MAGIC = 0x68766C6974650000  # "hvlite..": what the probe expects to find in a peer's memory


# The process this one let in with prctl(PR_SET_PTRACER) under Yama's ptrace_scope 1, and how
# many process sets rely on it.  A process has one such declaration for all its process sets
# (each decides in its own background thread), so it is withdrawn only when none relies on it.
_launcher_lock = threading.Lock()
_launcher: int | None = None
_launcher_users = 0


def _let_in_launcher(lineages: list[list[int] | None]) -> tuple[int | None, str | None]:
    """Under Yama's ``ptrace_scope`` 1 a process may reach another's memory only if that
    process declared it, or an ancestor of it, with ``prctl(PR_SET_PTRACER)``.  The ranks
    of a node descend from one launcher process (MPICH's ``hydra_pmi_proxy``, Open MPI's
    daemon, Slurm's ``slurmstepd``), maybe through wrappers of their own (a shell script,
    ``--output-filename``), so each rank declares the nearest process that is an ancestor
    of every rank: that lets in the job's own processes and none from outside the job
    (Open MPI's shared-memory transport lets in *any* process of the user).  ``lineages``:
    every rank's ancestors, nearest first.  Returns (the declared process or None, why
    direct copies are impossible or None); a declared process is released with
    :func:`_release_launcher` if the copies are not used after all."""
    global _launcher, _launcher_users
    launcher = cma.nearest_common_ancestor(lineages)
    if launcher is None:   # process 1 would let in every process of the machine
        return None, ("Yama's ptrace_scope is 1 and the ranks have no common launcher "
                      "process to let in (only process 1)")
    with _launcher_lock:
        if _launcher is None:
            try:
                cma.allow_tracer(launcher)
            except OSError as exc:
                return None, f"Yama's ptrace_scope is 1 and {exc.strerror or exc}"
            _launcher = launcher
        elif not all(_launcher in chain for chain in lineages if chain is not None):
            # Only one process may be declared; another set's would be replaced.
            return None, (f"Yama's ptrace_scope is 1 and another process set let in "
                          f"process {_launcher}, which not every rank descends from")
        _launcher_users += 1   # (a set within the one already declared: it covers them)
        return _launcher, None


def _release_launcher() -> None:
    """This set does not use the declaration after all: withdraw it if no set does."""
    global _launcher, _launcher_users
    with _launcher_lock:
        _launcher_users -= 1
        if _launcher_users == 0:
            _launcher = None
            try:
                cma.allow_tracer(0)
            except OSError:
                pass


class DirectCopyError(HvdliteError):
    """A copy between two ranks' memory failed in the middle of an allreduce; ``ranks``: the
    (global) ranks whose copies failed."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks or []


class DirectCopies:
    """Single-tensor allreduces of one process set's communicator by cross-memory attach."""

    def __init__(self, comm, max_sleep: float = 1e-3,
                 on_slow: Callable[[float], None] | None = None, required: bool = False,
                 global_ranks: list[int] | None = None) -> None:
        """``required``: the user asked for direct copies (``HVDLITE_DIRECT_COPIES=1``), so their
        absence is a warning instead of a note in the log.  ``global_ranks``: the global rank
        of each rank of ``comm``, for error messages (default: their ranks in ``comm``)."""
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.max_sleep = max_sleep
        self.on_slow = on_slow
        self.required = required
        self._names = list(global_ranks) if global_ranks is not None else list(range(self.size))
        self._copier: cma.CrossMemory | None = None
        self._decided = False
        self.unavailable_reason: str | None = None   # why not, once decided (tests, logs)
        self._pids: list[int] = []
        self._table = np.zeros((self.size, 3), dtype=np.int64)   # addresses, scale of each rank
        self._mine = np.zeros(3, dtype=np.int64)
        self._flags = np.zeros(self.size, dtype=np.int32)
        self._flag = np.zeros(1, dtype=np.int32)
        self._scratch = np.empty(_CHUNK_BYTES, dtype=np.uint8)
        self.singles = 0   # tensors reduced here (tests and benchmarks)
        self._abandoned: list[tuple[np.ndarray, np.ndarray]] = []

    @property
    def available(self) -> bool:
        """Whether the direct path is in use (decided on the first large allreduce)."""
        return self._copier is not None

    def usable(self, nbytes: int) -> bool:
        """Whether one tensor of ``nbytes`` is reduced here.  Collective: every rank calls it
        for the same response (the first call probes the peers)."""
        if self.size < 2 or nbytes < MIN_BYTES:
            return False
        if not self._decided:
            self._decide()
        return self._copier is not None

    # --- the one-time collective decision ------------------------------------------------------
    def _decide(self) -> None:
        self._decided = True
        copier = cma.load()
        reason = None if copier is not None else "process_vm_readv is not available here"
        if not all_on_one_node(self.comm):
            reason = reason or "the ranks are not all on one node"
        # Under Yama's ptrace_scope 1 the ranks must first let each other in (_let_in_launcher).
        lineage = cma.ancestors() if reason is None and cma.yama_scope() == 1 else None
        probe = np.array([_MAGIC | self.rank], dtype=np.int64)
        inbox = np.zeros(self.size, dtype=np.int64)
        posts = self.comm.allgather((os.getpid(), probe.ctypes.data, inbox.ctypes.data,
                                     lineage, reason))
        reasons = [why for *_, why in posts]
        declared = None
        if all(why is None for why in reasons) and any(post[3] is not None for post in posts):
            if lineage is not None:
                declared, reason = _let_in_launcher([post[3] for post in posts])
            reasons = self.comm.allgather(reason)   # every rank has declared before any reads
        if all(why is None for why in reasons):   # the same answer on every rank
            reasons = self.comm.allgather(self._probe(copier, posts, probe, inbox, declared))
        if all(why is None for why in reasons):
            self._copier, self._pids = copier, [pid for pid, *_ in posts]
            return
        if declared is not None:   # not used after all
            _release_launcher()
        why = next(f"rank {r}: {w}" for r, w in enumerate(reasons) if w is not None)
        self.unavailable_reason = why
        if self.rank == 0:
            (log.warning if self.required else log.info)(
                "hvdlite: direct copies between ranks (cross-memory attach) are unavailable "
                "(%s); large allreduces go through the shared-memory window or MPI instead. "
                "Where Yama's ptrace_scope (/proc/sys/kernel/yama/ptrace_scope) is 2 or more, "
                "or 1 and the ranks of a node have no common launcher process, ranks may not "
                "read each other's memory.", why)

    def _probe(self, copier: cma.CrossMemory, posts: list[tuple], probe: np.ndarray,
               inbox: np.ndarray, declared: int | None) -> str | None:
        """Read a known value out of every peer and write this rank's into every peer's inbox
        (``posts``: every rank's pid, probe and inbox addresses); why that failed, or None."""
        got = np.zeros(1, dtype=np.int64)
        reason = None
        try:
            for r, (pid, probe_at, inbox_at, _, _) in enumerate(posts):
                if r != self.rank:
                    copier.read(pid, probe_at, got)
                    if got[0] != _MAGIC | r:
                        raise OSError(None, f"read {got[0]:#x} from rank {r}'s process "
                                            f"{pid}, expected {_MAGIC | r:#x}")
                    copier.write(pid, inbox_at + 8 * self.rank, probe)
        except OSError as exc:
            reason = str(exc)
            if exc.errno == errno.EPERM and declared is not None:
                reason += (f" (Yama's ptrace_scope is 1, and every rank let in process "
                           f"{declared} and its descendants)")
        # Every rank's writes are done once this allgather completes.
        wrote = self.comm.allgather(reason)
        if reason is None:
            late = [r for r in range(self.size)
                    if r != self.rank and inbox[r] != _MAGIC | r and wrote[r] is None]
            if late:
                reason = f"the values written by rank(s) {late} did not arrive"
        return reason

    # --- one tensor ----------------------------------------------------------------------------
    def allreduce_one(self, src: np.ndarray, out: np.ndarray, ufunc, prescale: float,
                      postscale: float, name: str = "", crossing: Crossing | None = None) -> None:
        """``out = postscale * reduce(prescale_r * src_r over ranks r)`` for one flat contiguous
        array (``out`` may be ``src``); ``prescale`` is this rank's factor (a joined rank's
        stand-in passes 1.0, so the identity stays neutral).  ``crossing``, if given, exchanges
        this rank's reduced share with other hosts (the hierarchical path), piece by piece:
        each piece starts as soon as it is reduced here, and is scaled and written to the peers
        as soon as it is back, so the transfer overlaps the work on either side.  Every piece is
        exchanged even when a copy failed, so that ranks on other hosts are not left waiting,
        and the failure is raised after it."""
        try:
            self._allreduce_one(src, out, ufunc, prescale, postscale, name, crossing)
        except BaseException:
            # Abandoned half-way (a stall shutdown or a vanished rank raised from a wait): a
            # peer that is late, or stopped inside its copies, may still read this rank's input
            # and write its output.  Those arrays are kept for ever, so that such copies land
            # in memory they own instead of in whatever reuses it.
            self._abandoned.append((src, out))
            raise

    def _allreduce_one(self, src: np.ndarray, out: np.ndarray, ufunc, prescale: float,
                       postscale: float, name: str, crossing: Crossing | None) -> None:
        MPI = self._MPI
        copier, pids = self._copier, self._pids
        itemsize = src.dtype.itemsize
        mine = self._mine
        mine[0], mine[1] = src.ctypes.data, out.ctypes.data
        mine[2:3].view(np.float64)[0] = prescale
        table = self._table
        self._wait(self.comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T]))
        scales = table[:, 2].view(np.float64)
        # (rank, pid, input address, output address, prescale) of every peer, as plain numbers
        peers = [(r, pids[r], int(table[r, 0]), int(table[r, 1]), float(scales[r]))
                 for r in range(self.size) if r != self.rank]
        bounds = SharedWindow.shares(src.size, itemsize, self.size)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        step = max(1, _CHUNK_BYTES // itemsize)
        scratch = self._scratch[:step * itemsize].view(src.dtype)
        failure: OSError | None = None
        peer = -1   # the peer of the copy in progress
        pieces = crossing.pieces if crossing is not None else []
        started = written = 0   # pieces whose exchange started / that were written out

        def write(x: int, y: int) -> None:   # the finished elements x..y into every peer
            nonlocal peer
            for a in range(x, y, step):
                chunk = out[a:min(y, a + step)]
                scale_into(chunk, chunk, postscale)
                for peer, pid, _, out_at, _ in peers:
                    copier.write(pid, out_at + a * itemsize, chunk)

        def put(index: int) -> None:   # a piece back from the other hosts, to every peer
            nonlocal failure
            if failure is None:   # (a failed copy: the others still exchange every piece)
                try:
                    write(*pieces[index])
                except OSError as exc:
                    failure = exc

        def cross(until: int) -> None:   # start the pieces reduced by now, write those back
            nonlocal started, written
            while started < len(pieces) and pieces[started][1] <= until:
                a, b = pieces[started]
                crossing.start(started, out[a:b])
                started += 1
            while written < started and crossing.done(written):
                put(written)
                written += 1
        try:
            with np.errstate(all="ignore"):   # overflow wraps/saturates silently, as in MPI
                for x in range(lo, hi, step):
                    y = min(hi, x + step)
                    chunk = out[x:y]
                    part = scratch[:y - x]
                    # Own values first.  Out of place, copying them into the chunk first measured
                    # faster than combining straight from the input (memcpy spares the
                    # read-for-ownership of the cold output lines).
                    scale_into(chunk, src[x:y], prescale)
                    offset = x * itemsize
                    for peer, pid, src_at, _, scale in peers:
                        copier.read(pid, src_at + offset, part)
                        scale_into(part, part, scale)
                        ufunc(chunk, part, out=chunk)
                    if crossing is None:   # finish each chunk while it is in cache
                        write(x, y)
                    else:
                        cross(y)
        except OSError as exc:   # the others must still reach the end: tell them, then raise
            failure = exc
        if crossing is not None:
            with np.errstate(all="ignore"):
                cross(hi)   # (after a failure: the pieces not yet started, as they are)
                while written < len(pieces):
                    crossing.finish(written)
                    put(written)
                    written += 1
        self._flag[0] = failure is not None
        self._wait(self.comm.Iallgather([self._flag, MPI.INT32_T], [self._flags, MPI.INT32_T]))
        failed = [self._names[r] for r in range(self.size) if self._flags[r]]
        if not failed:
            self.singles += 1
            return
        head = (f"The allreduce of {name!r} failed: a direct copy between ranks' memory failed "
                f"on rank(s) {failed}")
        if failure is not None and failure.errno in (errno.ESRCH, errno.EFAULT):
            # The peer's buffers are held until it leaves the operation, and kept for ever if
            # it leaves by an error: its process has gone (or is going) away.
            raise DirectCopyError(
                f"{head}: rank {self._names[peer]}'s memory could not be reached ({failure}). "
                f"Its process has exited, or gave up on this allreduce and is ending (for "
                f"instance after HVDLITE_STALL_SHUTDOWN_TIME_SECONDS while this rank was not "
                f"responding); look at rank {self._names[peer]}'s errors. The result is "
                f"incomplete.", failed)
        here = f" (here: {failure})" if failure is not None else ""
        raise DirectCopyError(
            f"{head}{here}. Its result is incomplete on every rank. Set HVDLITE_DIRECT_COPIES=0 to "
            f"reduce through the shared-memory window instead.", failed)

    def _wait(self, request) -> None:
        wait_until(request.Test, self.max_sleep, on_slow=self.on_slow,
                   spin_seconds=PEER_SPIN_SECONDS)
