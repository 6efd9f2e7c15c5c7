"""Direct copies between ranks' memory (hvdlite/common/direct_allreduce.py) when they cannot be
used or fail: the collective decision when one rank cannot make them, and a copy that fails in
the middle of an allreduce.

argv[1]: "refused" (rank 1 finds no process_vm_readv: every rank must fall back to the
shared-memory window, with a note in the log, or a warning under HVDLITE_CMA=1) or
"copy_fails" (rank 1's second read of a peer's memory fails: every rank must raise a clear
error instead of hanging or returning a half-reduced result) or "peer_gone" (the same failure
as when the peer's process has gone: rank 1 must say that it could not reach its memory).
"""
import errno
import logging
import sys

import numpy as np

import hvdlite as hvd
from hvdlite.common import basics, cma, direct_allreduce
from _report import Reporter

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
    backend = basics.engine().backend
    assert not backend.direct.available and backend.direct.singles == 0
    assert backend.shared.singles == 1, "the refused tensor did not go through the window"
    reason = backend.direct.unavailable_reason
    assert reason == "rank 1: process_vm_readv is not available here", reason
    notes = [rec for rec in captured.records if "direct copies between ranks" in rec.getMessage()]
    if RANK != 0:
        assert notes == [], "only rank 0 reports"
        return
    want = logging.WARNING if basics.engine().config.cma == "on" else logging.INFO
    assert [rec.levelno for rec in notes] == [want], [(rec.levelname, rec.getMessage())
                                                      for rec in notes]
    assert reason in notes[0].getMessage() and "ptrace_scope" in notes[0].getMessage()


def copy_fails(code=errno.EPERM):
    xs = inputs("first")
    got = hvd.allreduce(xs[RANK], op=hvd.Sum, name="first")   # works: the probe succeeded
    np.testing.assert_array_equal(got, np.sum(xs, axis=0, dtype=np.float32))
    backend = basics.engine().backend
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
        assert "HVDLITE_CMA=0" in msg, msg
    assert ("injected" in msg) == (RANK == 1), msg
    try:   # the background thread has stopped: later operations say so instead of hanging
        hvd.allreduce(np.ones(3, np.float32), name="after")
    except hvd.HorovodInternalError as exc:
        assert "second" in str(exc) or "direct copy" in str(exc), str(exc)
    else:
        raise AssertionError("an operation after the failure succeeded")


assert cma.load() is not None, "process_vm_readv missing on a Linux test machine"
r.case(f"cma.{MODE}", {"refused": refused, "copy_fails": copy_fails,
                       "peer_gone": lambda: copy_fails(errno.EFAULT)}[MODE])
r.write()
hvd.shutdown()
