"""Direct copies between ranks' memory (hvdlite/common/intranode/direct_copies.py) when they cannot be
used or fail: the collective decision when one rank cannot make them, and a copy that fails in
the middle of an allreduce.

argv[1]: "refused" (rank 1 finds no process_vm_readv: every rank must fall back to the
shared-memory window, with a note in the log, or a warning under HVDLITE_DIRECT_COPIES=1) or
"copy_fails" (rank 1's second read of a peer's memory fails: every rank must raise a clear
error instead of hanging or returning a half-reduced result) or "peer_gone" (the same failure
as when the peer's process has gone: rank 1 must say that it could not reach its memory).

Yama's ptrace_scope 1, made to look so on every rank: "yama_prctl" (each rank really calls
prctl(PR_SET_PTRACER, its parent); a kernel without Yama refuses it, and every rank must keep
the window, naming the refusal), "yama_declared" (the declaration is recorded instead: each
rank declares its launcher, its parent, once and keeps it, and the copies are used),
"yama_wrapped" (the same with each rank under a wrapper process of its own: the launcher is the
wrappers' parent), "yama_no_launcher" (rank 1 looks started by process 1: no rank declares
anything, and none uses the copies) and "yama_withdrawn" (rank 1's probe is refused after every
rank declared: every rank withdraws its declaration and keeps the window), "yama_sets" (one
declaration serves every process set; a failing set withdraws nothing; needs
HVDLITE_DYNAMIC_PROCESS_SETS=1).
"""
import errno
import logging
import os
import sys

import numpy as np

import hvdlite as hvd
from tests.workers.nodes import intranode  # noqa: E402
from hvdlite.common.runtime import state, registry
from hvdlite.common.intranode import cma
from hvdlite.common.intranode import direct_copies as direct_allreduce
from tests.workers._report import Reporter

MODE = sys.argv[1]


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


captured = Captured()
logger = logging.getLogger("hvdlite")
logger.addHandler(captured)
hvd.init()
logger.setLevel(logging.INFO)   # (init sets it from HVDLITE_LOG_LEVEL)
RANK, SIZE = hvd.rank(), hvd.size()
COUNT = (4 << 20) // 4 + 11   # float32: one 4 MiB tensor, over the direct path's minimum
r = Reporter(RANK)


def inputs(tag):
    return [np.arange(COUNT, dtype=np.float32) * (k + 1) + len(tag) for k in range(SIZE)]


def refused():
    if RANK == 1:
        direct_allreduce.cma.load = lambda: None
    xs = inputs("refused")
    got = hvd.allreduce(xs[RANK], op=hvd.Sum, name="refused")
    np.testing.assert_array_equal(got, np.sum(xs, axis=0, dtype=np.float32))
    backend = intranode(state.engine())
    assert not backend.direct.available and backend.direct.singles == 0
    assert backend.shared.singles == 1, "the refused tensor did not go through the window"
    reason = backend.direct.unavailable_reason
    assert reason == "rank 1: process_vm_readv is not available here", reason
    notes = [rec for rec in captured.records if "direct copies between ranks" in rec.getMessage()]
    if RANK != 0:
        assert notes == [], "only rank 0 reports"
        return
    want = logging.WARNING if state.engine().config.direct_copies == "on" else logging.INFO
    assert [rec.levelno for rec in notes] == [want], [(rec.levelname, rec.getMessage())
                                                      for rec in notes]
    assert reason in notes[0].getMessage() and "ptrace_scope" in notes[0].getMessage()


def copy_fails(code=errno.EPERM):
    xs = inputs("first")
    got = hvd.allreduce(xs[RANK], op=hvd.Sum, name="first")   # works: the probe succeeded
    np.testing.assert_array_equal(got, np.sum(xs, axis=0, dtype=np.float32))
    backend = intranode(state.engine())
    assert backend.direct.available and backend.direct.singles == 1
    if RANK == 1:
        real = backend.direct._copier.read

        def failing(pid, address, dst):
            raise OSError(code, f"process_vm_readv in process {pid} failed: injected")
        backend.direct._copier.read = failing
    work = inputs("second")[RANK].copy()
    try:
        hvd.allreduce_(work, op=hvd.Sum, name="second")
    except hvd.HorovodInternalError as exc:
        msg = str(exc)
    else:
        raise AssertionError("the allreduce whose copy failed returned normally")
    if RANK == 1:
        backend.direct._copier.read = real
    for part in ("'second'", "rank(s) [1]", "incomplete"):
        assert part in msg, f"{part!r} missing from: {msg}"
    if code == errno.EFAULT and RANK == 1:   # its peer's memory is gone: it says so
        assert "rank 0's memory could not be reached" in msg and "exited" in msg, msg
    else:
        assert "HVDLITE_DIRECT_COPIES=0" in msg, msg
    assert ("injected" in msg) == (RANK == 1), msg
    try:   # the background thread has stopped: later operations say so instead of hanging
        hvd.allreduce(np.ones(3, np.float32), name="after")
    except hvd.HorovodInternalError as exc:
        assert "second" in str(exc) or "direct copy" in str(exc), str(exc)
    else:
        raise AssertionError("an operation after the failure succeeded")


def reduce_once(tag):
    xs = inputs(tag)
    got = hvd.allreduce(xs[RANK], op=hvd.Sum, name=tag)
    np.testing.assert_array_equal(got, np.sum(xs, axis=0, dtype=np.float32))
    return intranode(state.engine())


def yama_prctl():
    real_scope = cma.yama_scope()
    cma.yama_scope = lambda path=None: 1
    backend = reduce_once("yama_prctl")
    if real_scope is None:   # no Yama in this kernel: prctl(PR_SET_PTRACER) is refused
        assert not backend.direct.available and backend.shared.singles == 1
        reason = backend.direct.unavailable_reason
        assert reason.startswith("rank 0: Yama's ptrace_scope is 1 and prctl(PR_SET_PTRACER, "), \
            reason
        assert "Invalid argument" in reason, reason
    elif real_scope <= 1:    # the declaration lets the ranks in
        assert backend.direct.available and backend.direct.singles == 1, \
            backend.direct.unavailable_reason
    else:                    # only CAP_SYS_PTRACE would
        assert not backend.direct.available and backend.shared.singles == 1


def declared_calls():
    calls = []
    cma.yama_scope = lambda path=None: 1
    cma.allow_tracer = calls.append
    return calls


def parent_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def yama_declared(launcher):
    calls = declared_calls()
    backend = reduce_once("yama_declared")
    assert backend.direct.available and backend.direct.singles == 1, \
        backend.direct.unavailable_reason
    assert calls == [launcher], (calls, launcher)   # the launcher, once, and kept


def yama_no_launcher():
    calls = declared_calls()
    if RANK == 1:   # as if rank 1 had been started by process 1, outside the launcher
        cma.ancestors = lambda: []
    backend = reduce_once("yama_no_launcher")
    assert not backend.direct.available and backend.shared.singles == 1
    assert backend.direct.unavailable_reason == (
        "rank 0: Yama's ptrace_scope is 1 and the ranks have no common launcher process to let "
        "in (only process 1)"), backend.direct.unavailable_reason
    assert calls == [], calls   # never process 1: that would be every process of the machine


def refuse_later_reads():
    """Copiers loaded from now on (by the next probe) have every read refused, as by Yama."""
    real_load = cma.load

    def load():
        copier = real_load()

        def refused(pid, address, dst):
            raise OSError(errno.EPERM, "process_vm_readv refused: injected")
        copier.read = refused
        return copier
    direct_allreduce.cma.load = load


def yama_withdrawn():
    calls = declared_calls()
    if RANK == 1:   # the kernel refuses rank 1's probe anyway
        refuse_later_reads()
    backend = reduce_once("yama_withdrawn")
    assert not backend.direct.available and backend.shared.singles == 1
    reason = backend.direct.unavailable_reason
    assert reason.startswith("rank 1: [Errno 1] process_vm_readv refused: injected (Yama's "
                             "ptrace_scope "
                             f"is 1, and every rank let in process {os.getppid()} and its "
                             "descendants)"), reason
    assert calls == [os.getppid(), 0], calls   # declared, then withdrawn on every rank


def yama_sets():
    """One declaration serves every process set: a set inside it declares nothing new, and a
    set whose probe fails must not withdraw what the global set still uses."""
    calls = declared_calls()
    reduce_once("yama_sets.global")
    assert calls == [os.getppid()], calls
    pair_ranks = [0, 1]
    for attempt, fails in (("ok", False), ("fails", True)):
        pair = hvd.add_process_set(pair_ranks)
        if RANK in pair_ranks:
            if fails and RANK == 1:
                refuse_later_reads()
            xs = inputs(attempt)[:2]
            got = hvd.allreduce(xs[RANK], op=hvd.Sum, name=f"pair.{attempt}", process_set=pair)
            np.testing.assert_array_equal(got, xs[0] + xs[1])
            direct = intranode(registry.process_set_engine(pair, "test")[0]).direct
            assert direct.available != fails, direct.unavailable_reason
        hvd.remove_process_set(pair)
        assert calls == [os.getppid()], (attempt, calls)   # nothing new, nothing withdrawn
    backend = reduce_once("yama_sets.after")
    assert backend.direct.available and backend.direct.singles == 2


assert cma.load() is not None, "process_vm_readv missing on a Linux test machine"
r.case(f"cma.{MODE}", {"refused": refused, "copy_fails": copy_fails,
                       "peer_gone": lambda: copy_fails(errno.EFAULT),
                       "yama_prctl": yama_prctl,
                       "yama_declared": lambda: yama_declared(os.getppid()),
                       # started by hvdlite run --output-filename's wrapper, one per rank: the
                       # launcher is the wrappers' parent
                       "yama_wrapped": lambda: yama_declared(parent_of(os.getppid())),
                       "yama_no_launcher": yama_no_launcher,
                       "yama_withdrawn": yama_withdrawn, "yama_sets": yama_sets}[MODE])
r.write()
hvd.shutdown()
