"""The fast submission path for host allreduces (submission.fast_host_allreduce): once a
(dtype, op) pair passed the full checks, later named allreduces of it skip make_entry.  These
cases prove the fast path is taken, gives the right results, and still rejects (through the
general path, with the same errors) everything the general path rejects.
"""
import numpy as np

import hvdlite as hvd
from hvdlite.common.api import submission
from tests.workers.core_refs import (allreduce_expected, attempt, check_array, check_exact,
                                     noncontiguous)
from tests.workers._report import Reporter

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)


def data(rank: int, n: int = 37, dtype="float32") -> np.ndarray:
    return ((np.arange(n) * 7 + rank * 3) % 23).astype(dtype)


def warm(dtype: str, op) -> None:
    """One allreduce through the general path: the pair is now known to the fast path."""
    hvd.allreduce(data(RANK, dtype=dtype), op=op, name=f"fast.warm.{dtype}.{int(op)}")
    checked = submission._checked_host_allreduce
    assert (np.dtype(dtype), op) in checked, checked


def fast_path_taken():
    """With make_entry disabled, named allreduces of a known pair still run, correctly:
    in place, out of place, with scale factors, on a 3-D shape."""
    warm("float32", hvd.Sum)
    warm("int64", hvd.Average)
    original = submission.make_entry

    def general_path_used(*args, **kwargs):
        raise AssertionError("make_entry ran: the fast path was not taken")

    submission.make_entry = general_path_used
    try:
        inputs = [data(k) for k in range(SIZE)]
        work = inputs[RANK].copy()
        got_inplace = hvd.allreduce_(work, op=hvd.Sum, name="fast.inplace")
        assert got_inplace is work, "allreduce_ must return its input"
        got_new = hvd.allreduce(inputs[RANK], op=hvd.Sum, name="fast.new")
        scaled = hvd.allreduce(inputs[RANK], op=hvd.Sum, name="fast.scaled",
                               prescale_factor=0.5, postscale_factor=3.0)
        cube = [data(k, 60).reshape(3, 4, 5) for k in range(SIZE)]
        got_cube = hvd.allreduce_async(cube[RANK], op=hvd.Sum, name="fast.cube").wait()
        ints = [data(k, dtype="int64") for k in range(SIZE)]
        got_avg = hvd.allreduce(ints[RANK], op=hvd.Average, name="fast.avg")
    finally:
        submission.make_entry = original
    expected = allreduce_expected(inputs, "float32", "Sum", SIZE)
    check_array("in place", work, expected)
    check_array("out of place", got_new, expected)
    check_exact("input untouched", inputs[RANK], data(RANK))
    check_array("scaled", scaled, allreduce_expected(inputs, "float32", "Sum", SIZE, 0.5, 3.0))
    assert got_cube.shape == (3, 4, 5), got_cube.shape
    check_array("3-D", got_cube, allreduce_expected(cube, "float32", "Sum", SIZE))
    check_array("int64 average", got_avg, allreduce_expected(ints, "int64", "Average", SIZE))


def fast_path_keeps_the_checks():
    """Known pair, unusual call: each one falls back to the general path, which does the
    right thing (a copy for a non-contiguous input) or raises its usual error."""
    warm("float32", hvd.Sum)
    base = data(RANK, 40)
    view, _ = noncontiguous(base)
    got = hvd.allreduce_(view, op=hvd.Sum, name="fast.noncontig")
    expected = allreduce_expected([data(k, 40) for k in range(SIZE)], "float32", "Sum", SIZE)
    check_array("non-contiguous in place", got, expected)
    check_array("non-contiguous view written back", view, expected)
    readonly = data(RANK)
    readonly.flags.writeable = False
    err = attempt(lambda: hvd.allreduce_(readonly, op=hvd.Sum, name="fast.readonly"))
    assert isinstance(err, ValueError) and "read-only" in str(err), repr(err)
    err = attempt(lambda: hvd.allreduce(data(RANK), op=hvd.Sum, name=7))
    assert isinstance(err, TypeError) and "name must be a string" in str(err), repr(err)
    held = hvd.allreduce_async(data(RANK), op=hvd.Sum, name="fast.twice")
    err = attempt(lambda: hvd.allreduce_async(data(RANK), op=hvd.Sum, name="fast.twice"))
    assert isinstance(err, hvd.DuplicateNameError), repr(err)
    held.wait()
    # integer scale factors are converted by the general path, as before
    got = hvd.allreduce(data(RANK), op=hvd.Sum, name="fast.intscale", prescale_factor=2)
    check_array("integer prescale", got,
                allreduce_expected([data(k) for k in range(SIZE)], "float32", "Sum", SIZE, 2.0))
    # a different dtype or op is not known yet: the general path checks it
    err = attempt(lambda: hvd.allreduce(np.ones(3, bool), op=hvd.Average, name="fast.bool"))
    assert isinstance(err, hvd.UnsupportedDtypeError), repr(err)


def fast_path_mismatch():
    """A shape that differs across ranks, submitted through the fast path, fails on every rank
    with the usual message, and the next operation works."""
    warm("float32", hvd.Sum)
    err = attempt(lambda: hvd.allreduce(data(RANK, 10 + RANK), op=hvd.Sum, name="fast.mm"))
    assert isinstance(err, hvd.TensorMismatchError), repr(err)
    assert "fast.mm" in str(err) and "shape" in str(err), str(err)
    got = hvd.allreduce(data(RANK), op=hvd.Sum, name="fast.after")
    check_array("after the mismatch", got,
                allreduce_expected([data(k) for k in range(SIZE)], "float32", "Sum", SIZE))


r.case("fast.taken", fast_path_taken)
r.case("fast.checks", fast_path_keeps_the_checks)
r.case("fast.mismatch", fast_path_mismatch)
r.write()
hvd.shutdown()
