"""The fast submission path for host allreduces (submission.fast_host_allreduce): once a
(dtype, op) pair passed the full checks, later named allreduces of it skip make_entry.  These
cases prove the fast path is taken, gives the right results, and still rejects (through the
general path, with the same errors) everything the general path rejects.
"""
import numpy as np

import hvdlite as hvd
from hvdlite.common.api import grouped, submission
from hvdlite.common.engine import messages as hvd_messages
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
    assert np.dtype(dtype) in checked.get(op, {}), checked


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


def no_general_path():
    """make_entry replaced by a function that fails the case if it is called."""
    original = submission.make_entry

    def general_path_used(*args, **kwargs):
        raise AssertionError("make_entry ran: the fast path was not taken")

    submission.make_entry = general_path_used
    grouped.make_entry = general_path_used
    return original


def general_path_back(original) -> None:
    submission.make_entry = grouped.make_entry = original


def fast_group_taken():
    """A grouped allreduce whose members' dtypes are known skips make_entry for every member:
    in place, out of place, unnamed, with scale factors, several dtypes and shapes."""
    warm("float32", hvd.Sum)
    warm("int64", hvd.Sum)
    warm("float64", hvd.Average)
    shapes = [(5,), (3, 4), (), (2, 3, 2), (0,)]
    every = [[data(k, int(np.prod(s)) or 0).reshape(s) for k in range(SIZE)] for s in shapes]
    ints = [data(k, 9, "int64") for k in range(SIZE)]
    floats64 = [data(k, 11, "float64") for k in range(SIZE)]
    work = [per_rank[RANK].copy() for per_rank in every]
    original = no_general_path()
    try:
        got_inplace = hvd.grouped_allreduce_(work + [ints[RANK].copy()], op=hvd.Sum,
                                             name="fast.g.inplace")
        got_new = hvd.grouped_allreduce([p[RANK] for p in every] + [ints[RANK]], op=hvd.Sum,
                                        name="fast.g.new")
        got_unnamed = hvd.grouped_allreduce([p[RANK] for p in every], op=hvd.Sum)
        got_scaled = hvd.grouped_allreduce([p[RANK] for p in every], op=hvd.Sum,
                                           prescale_factor=0.5, postscale_factor=3.0,
                                           name="fast.g.scaled")
        got_avg = hvd.grouped_allreduce([floats64[RANK]], op=hvd.Average, name="fast.g.avg")
        # given outputs (the TensorFlow adapter's flat group: views of one result buffer)
        flat_out = np.empty(sum(p[RANK].size for p in every), np.float32)
        starts = np.cumsum([0] + [p[RANK].size for p in every])
        outs = [flat_out[a:b].reshape(p[RANK].shape)
                for a, b, p in zip(starts, starts[1:], every)]
        got_given = grouped.submit_group(hvd_messages.ALLREDUCE, [p[RANK] for p in every],
                                         name="fast.g.given", outputs=outs,
                                         reduce_op=hvd.Sum).wait()
    finally:
        general_path_back(original)
    for i, (g, o) in enumerate(zip(got_given, outs)):
        assert g is o, f"member {i}: the result is not the given output"
    expected = [allreduce_expected(p, "float32", "Sum", SIZE) for p in every]
    for label, got in (("in place", got_inplace), ("out of place", got_new),
                       ("unnamed", got_unnamed), ("given outputs", got_given)):
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g.shape == e.shape, (label, i, g.shape, e.shape)
            check_array(f"{label} member {i}", g, e)
    for g, w in zip(got_inplace, work):
        assert g is w, "grouped_allreduce_ must return its inputs"
    for i, per_rank in enumerate(every):
        check_exact(f"input {i} untouched", per_rank[RANK], data(RANK, per_rank[RANK].size)
                    .reshape(per_rank[RANK].shape))
    check_array("int64 in place", got_inplace[-1],
                allreduce_expected(ints, "int64", "Sum", SIZE))
    check_array("int64 out of place", got_new[-1],
                allreduce_expected(ints, "int64", "Sum", SIZE))
    for i, (g, p) in enumerate(zip(got_scaled, every)):
        check_array(f"scaled member {i}", g, allreduce_expected(p, "float32", "Sum", SIZE,
                                                                0.5, 3.0))
    check_array("float64 average", got_avg[0],
                allreduce_expected(floats64, "float64", "Average", SIZE))


def fast_group_keeps_the_checks():
    """Known pairs, unusual groups: each one falls back to the general path, which does what it
    always did (reduces a member of a new dtype or op, copies a non-contiguous one) or raises
    its usual error; a shape that differs across ranks fails the whole group, naming it."""
    warm("float32", hvd.Sum)
    inputs = [data(k) for k in range(SIZE)]
    expected = allreduce_expected(inputs, "float32", "Sum", SIZE)
    base = data(RANK, 74)
    view = base[::2]   # non-contiguous: copied by the general path
    got = hvd.grouped_allreduce([inputs[RANK], view], op=hvd.Sum, name="fast.g.noncontig")
    check_array("member 0 beside a non-contiguous one", got[0], expected)
    check_array("non-contiguous member", got[1],
                allreduce_expected([data(k, 74)[::2] for k in range(SIZE)], "float32", "Sum",
                                   SIZE))
    got = hvd.grouped_allreduce([inputs[RANK], data(RANK, dtype="int16")], op=hvd.Max,
                                name="fast.g.newpair")
    check_array("new pair", got[1], allreduce_expected([data(k, dtype="int16")
                                                        for k in range(SIZE)], "int16", "Max",
                                                       SIZE))
    readonly = data(RANK)
    readonly.flags.writeable = False
    got = hvd.grouped_allreduce([readonly], op=hvd.Sum, name="fast.g.readonly")
    check_array("read-only input, out of place", got[0], expected)
    err = attempt(lambda: hvd.grouped_allreduce_([data(RANK), readonly], op=hvd.Sum,
                                                 name="fast.g.readonly_"))
    assert isinstance(err, ValueError) and "writable" in str(err), repr(err)
    err = attempt(lambda: hvd.grouped_allreduce([data(RANK), np.ones(3, bool)],
                                                op=hvd.Average, name="fast.g.bool"))
    assert isinstance(err, hvd.UnsupportedDtypeError), repr(err)
    err = attempt(lambda: hvd.grouped_allreduce([data(RANK), data(RANK, 10 + RANK)],
                                                op=hvd.Sum, name="fast.g.mm"))
    assert isinstance(err, hvd.TensorMismatchError), repr(err)
    assert "fast.g.mm.1" in str(err) and "shape" in str(err), str(err)
    held = hvd.grouped_allreduce_async([data(RANK)], op=hvd.Sum, name="fast.g.twice")
    err = attempt(lambda: hvd.grouped_allreduce_async([data(RANK)], op=hvd.Sum,
                                                      name="fast.g.twice"))
    assert isinstance(err, hvd.DuplicateNameError), repr(err)
    held.wait()
    got = hvd.grouped_allreduce([data(RANK)], op=hvd.Sum, name="fast.g.after")
    check_array("after the failures", got[0], expected)


r.case("fast.taken", fast_path_taken)
r.case("fast.checks", fast_path_keeps_the_checks)
r.case("fast.mismatch", fast_path_mismatch)
r.case("fast.group", fast_group_taken)
r.case("fast.group_checks", fast_group_keeps_the_checks)
r.write()
hvd.shutdown()
