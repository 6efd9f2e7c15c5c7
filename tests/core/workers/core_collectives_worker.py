"""alltoall, reducescatter, grouped ops and op-level Adasum against numpy references, on every rank.

Run under ``mpiexec`` at 2, 3 and 4 ranks (tests/core/test_collectives.py).  Each rank
regenerates every rank's input from the case name (core_cases.op_input / rng_for), so it computes
the expected result of every collective locally with numpy: exactly for integers, bool and
exactly-representable float inputs, within a few roundings otherwise (core_refs.allreduce_expected).
Within a case every collective is issued (errors captured with ``attempt``) before anything is
checked, so a failing check on one rank never leaves the others waiting on a collective it skipped.

Importable without MPI: ``cases_for(size)`` lists the cases a job of ``size`` ranks reports.
"""
from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # sibling helper modules

import numpy as np  # noqa: E402

import hvdlite as hvd  # noqa: E402
from tests.workers._report import CaseRegistry, pow2  # noqa: E402
from tests.workers import core_cases as cc  # noqa: E402
from core_adasum_kernel_worker import adasum_tree, check_close  # noqa: E402
from tests.workers.core_refs import (Expected, allreduce_expected, attempt,  # noqa: E402
                                     check_array, check_exact)

RANK = SIZE = LAST = -1      # set by main() after hvd.init()
OP = {name: getattr(hvd, name) for name in cc.OPS}

# --- case registry -----------------------------------------------------------------------------
CASES = CaseRegistry()
register, case = CASES.register, CASES.case


def _not_pow2(size: int) -> bool:
    return not pow2(size)


def cases_for(size: int) -> list[str]:
    return CASES.names_for(size)


# --- shared helpers ----------------------------------------------------------------------------
def others(odd: int) -> list[int]:
    return [k for k in range(SIZE) if k != odd]


def raised(outcome, cls, *fragments: str) -> str:
    """Assert ``outcome`` is an exception of ``cls`` whose text has every fragment."""
    if not isinstance(outcome, cls):
        raise AssertionError(f"expected {cls.__name__}, got {outcome!r}")
    msg = str(outcome)
    for frag in fragments:
        assert frag in msg, f"message lacks {frag!r}: {msg}"
    return msg


def labelled(label: str, fn, *args) -> None:
    """Run a check; prefix its failure with ``label``."""
    try:
        fn(*args)
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from None


def mismatch(outcome, name: str, odd: int, *fragments: str) -> str:
    """A TensorMismatchError naming the tensor, the odd rank out and the others."""
    return raised(outcome, hvd.TensorMismatchError, name, str([odd]), str(others(odd)),
                  *fragments)


def finish(h):
    """Wait for a handle (or pass on the exception its submission raised)."""
    if isinstance(h, BaseException):
        return h
    got = attempt(lambda: hvd.synchronize(h))
    if not isinstance(got, BaseException) and not h.poll():
        return AssertionError(f"poll() is False after wait on {h!r}")
    return got


def sum_ints(n: int = 4) -> tuple[list[np.ndarray], Expected]:
    xs = [np.arange(n, dtype=np.int64) * (k + 1) - k for k in range(SIZE)]
    return xs, allreduce_expected(xs, "int64", "Sum", SIZE)


def follow_up_allreduce(name: str):
    """Issue a plain allreduce after an error; returns a check to run once all ranks issued."""
    xs, exp = sum_ints()
    got = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name=name))
    return lambda: check_array(f"follow-up allreduce {name!r}", got, exp)


def rows_of(total: int, parts: int) -> list[int]:
    """Documented reducescatter split: the first ``total % parts`` ranks get one extra row."""
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


def row_slice(exp: Expected, total: int, rank: int) -> Expected:
    """The rows of the full reduction ``exp`` that ``rank`` receives from reducescatter."""
    rows = rows_of(total, SIZE)
    a = sum(rows[:rank])
    b = a + rows[rank]
    if exp.exact is not None:
        return Expected(exp.dtype, exact=exp.exact[a:b])
    tol = np.broadcast_to(exp.tol, exp.ref64.shape)
    return Expected(exp.dtype, ref64=exp.ref64[a:b], tol=tol[a:b])


def small_int_input(case_name: str, rank: int, dtype: str, op: str, shape: tuple) -> np.ndarray:
    """Inputs for scaled integer reductions (small, so products stay in range; or wrap
    identically in the reference)."""
    if dtype in cc.FLOAT_DTYPES:
        return cc.op_input(case_name, rank, dtype, op, shape)
    dt = cc.np_dtype(dtype)
    hi = 2 if op == "Product" else 7
    lo = -hi if dt.kind == "i" else 0
    return cc.rng_for(case_name, rank).integers(lo, hi + 1, size=shape).astype(dt)


# --- alltoall ----------------------------------------------------------------------------------
A2A_TRAILING = {"vec": (), "cube": (2, 3)}   # 1-D and 3-D inputs


def a2a_splits(tag: str, rank: int, hi: int = 3) -> list[int]:
    return [int(n) for n in cc.rng_for(tag, rank, "splits").integers(0, hi + 1, size=SIZE)]


def a2a_input(tag: str, rank: int, dtype: str, splits, trailing=()) -> np.ndarray:
    return cc.op_input(tag, rank, dtype, "Sum", (int(sum(splits)),) + tuple(trailing))


def a2a_expected(inputs: list[np.ndarray], splits: list, me: int):
    """(rows ``me`` receives, in rank order; how many from each rank)."""
    parts = []
    for x, s in zip(inputs, splits):
        start = int(sum(s[:me]))
        parts.append(x[start:start + s[me]])
    return np.concatenate(parts), np.array([s[me] for s in splits], dtype=np.int32)


def check_a2a(label: str, got, want) -> None:
    if isinstance(got, BaseException):
        raise AssertionError(f"{label}: raised {type(got).__name__}: {got}")
    assert isinstance(got, tuple) and len(got) == 2, f"{label}: result is {got!r}"
    received, received_splits = got
    check_exact(f"{label}: received", received, want[0])
    assert isinstance(received_splits, np.ndarray), f"{label}: splits are {received_splits!r}"
    assert received_splits.dtype == np.int32, f"{label}: splits dtype {received_splits.dtype}"
    assert received_splits.tolist() == want[1].tolist(), (
        f"{label}: received_splits {received_splits.tolist()} != {want[1].tolist()}")


def a2a_follow_up(name: str):
    """A successful alltoall under ``name`` after an error; returns its check."""
    splits = [a2a_splits(name + ".ok", k) for k in range(SIZE)]
    inputs = [a2a_input(name + ".ok", k, "int32", splits[k], (2,)) for k in range(SIZE)]
    got = attempt(lambda: hvd.alltoall(inputs[RANK], splits[RANK], name=name))
    check_ar = follow_up_allreduce(name + ".ar")

    def check():
        check_a2a(f"follow-up alltoall {name!r}", got, a2a_expected(inputs, splits, RANK))
        check_ar()
    return check


def a2a_dtype_case(name: str, dtype: str, shape_key: str) -> None:
    """Uneven splits (sync, splits as list; async, splits as numpy array) and even division."""
    trailing = A2A_TRAILING[shape_key]
    splits = [a2a_splits(name, k) for k in range(SIZE)]
    inputs = [a2a_input(name, k, dtype, splits[k], trailing) for k in range(SIZE)]
    even = [cc.op_input(name + ".even", k, dtype, "Sum", (2 * SIZE,) + trailing)
            for k in range(SIZE)]
    x = inputs[RANK]
    before = x.copy()
    h = attempt(lambda: hvd.alltoall_async(x, splits=np.array(splits[RANK]), name=name + ".a"))
    sync = attempt(lambda: hvd.alltoall(x, splits=splits[RANK], name=name))
    got_even = attempt(lambda: hvd.alltoall(even[RANK], name=name + ".even"))
    got_async = finish(h)
    want = a2a_expected(inputs, splits, RANK)
    check_a2a("sync", sync, want)
    check_a2a("async", got_async, want)
    check_a2a("splits=None", got_even, a2a_expected(even, [[2] * SIZE] * SIZE, RANK))
    assert np.array_equal(x, before), "alltoall changed its input"


for _dt in cc.DTYPES:
    for _shape in A2A_TRAILING:
        _name = f"alltoall.{_dt}.{_shape}"
        register(_name, functools.partial(a2a_dtype_case, _name, _dt, _shape))


def a2a_fixed(name: str, splits: list[list[int]], trailing=(3,), dtype="float32") -> None:
    inputs = [a2a_input(name, k, dtype, splits[k], trailing) for k in range(SIZE)]
    got = attempt(lambda: hvd.alltoall(inputs[RANK], splits[RANK], name=name))
    got_a = finish(attempt(lambda: hvd.alltoall_async(inputs[RANK], splits[RANK],
                                                      name=name + ".a")))
    want = a2a_expected(inputs, splits, RANK)
    check_a2a("sync", got, want)
    check_a2a("async", got_a, want)


@case("alltoall.rank_sends_nothing")
def a2a_rank_sends_nothing():
    splits = [[0] * SIZE if k == 0 else [k + j % 2 for j in range(SIZE)] for k in range(SIZE)]
    a2a_fixed("a2a.sends_nothing", splits)


@case("alltoall.rank_receives_nothing")
def a2a_rank_receives_nothing():
    splits = [[0 if j == LAST else 1 + (k + j) % 3 for j in range(SIZE)] for k in range(SIZE)]
    a2a_fixed("a2a.receives_nothing", splits, trailing=(2, 2), dtype="int16")


@case("alltoall.nobody_sends_anything")
def a2a_all_empty():
    a2a_fixed("a2a.all_empty", [[0] * SIZE for _ in range(SIZE)], dtype="int64")


@case("alltoall.one_rank_sends_everything_to_one")
def a2a_one_to_one():
    splits = [[0] * SIZE for _ in range(SIZE)]
    splits[LAST][0] = 5
    a2a_fixed("a2a.one_to_one", splits, trailing=(), dtype="uint8")


@case("alltoall.splits_as_list_tuple_and_arrays")
def a2a_splits_types():
    splits = [a2a_splits("a2a.types", k) for k in range(SIZE)]
    inputs = [a2a_input("a2a.types", k, "int32", splits[k], (2,)) for k in range(SIZE)]
    mine = splits[RANK]
    forms = {"list": list(mine), "tuple": tuple(mine), "int32": np.array(mine, np.int32),
             "int64": np.array(mine, np.int64), "uint8": np.array(mine, np.uint8)}
    handles = {k: attempt(lambda v=v, k=k: hvd.alltoall_async(inputs[RANK], v,
                                                               name=f"a2a.types.{k}"))
               for k, v in forms.items()}
    got = {k: finish(h) for k, h in handles.items()}
    want = a2a_expected(inputs, splits, RANK)
    for k, g in got.items():
        check_a2a(f"splits as {k}", g, want)


@case("alltoall.empty_trailing_dims")
def a2a_empty_trailing():
    for i, trailing in enumerate([(0,), (2, 0), (0, 3)]):
        splits = [a2a_splits(f"a2a.empty{i}", k) for k in range(SIZE)]
        inputs = [np.zeros((sum(splits[k]),) + trailing, np.float64) for k in range(SIZE)]
        got = attempt(lambda: hvd.alltoall(inputs[RANK], splits[RANK], name=f"a2a.empty{i}"))
        check_a2a(f"trailing {trailing}", got, a2a_expected(inputs, splits, RANK))


@case("alltoall.noncontiguous_input")
def a2a_noncontiguous():
    splits = [a2a_splits("a2a.nc", k) for k in range(SIZE)]
    inputs = [a2a_input("a2a.nc", k, "float64", splits[k], (3,)) for k in range(SIZE)]
    view = np.asfortranarray(inputs[RANK])
    if view.shape[0] > 1:
        assert not view.flags.c_contiguous
    got = attempt(lambda: hvd.alltoall(view, splits[RANK], name="a2a.nc"))
    check_a2a("noncontiguous", got, a2a_expected(inputs, splits, RANK))


@case("alltoall.unnamed")
def a2a_unnamed():
    got = []
    wants = []
    for i in range(3):
        splits = [a2a_splits(f"a2a.unnamed{i}", k) for k in range(SIZE)]
        inputs = [a2a_input(f"a2a.unnamed{i}", k, "int8", splits[k]) for k in range(SIZE)]
        got.append(attempt(lambda: hvd.alltoall(inputs[RANK], splits[RANK])))
        wants.append(a2a_expected(inputs, splits, RANK))
    for i, (g, w) in enumerate(zip(got, wants)):
        check_a2a(f"unnamed #{i}", g, w)


@case("alltoall.repeated_name_changing_splits")
def a2a_repeated():
    """Same name every step; splits stay, change on one rank only, change everywhere, or go
    back: the response cache must never serve another step's splits."""
    variants = [0, 0, 0, 1, 2, 2, 3, 0, 0, 4]
    results = []
    for step, v in enumerate(variants):
        def splits_of(k, v=v):
            if v == 1 and k != LAST:       # only the last rank changes its splits
                return a2a_splits("a2a.rep.v0", k)
            if v == 4:                     # only rank 0 changes, to all zeros
                return [0] * SIZE if k == 0 else a2a_splits("a2a.rep.v0", k)
            return a2a_splits(f"a2a.rep.v{v}", k, hi=2 + v)
        splits = [splits_of(k) for k in range(SIZE)]
        inputs = [a2a_input(f"a2a.rep.step{step}", k, "float32", splits[k], (2,))
                  for k in range(SIZE)]
        got = attempt(lambda: hvd.alltoall(inputs[RANK], splits[RANK], name="a2a.rep"))
        results.append((step, got, a2a_expected(inputs, splits, RANK)))
    for step, got, want in results:
        check_a2a(f"step {step}", got, want)


@case("alltoall.async_many_in_flight")
def a2a_async_many():
    specs = [("float32", (3,)), ("int64", ()), ("uint8", (2, 2)), ("bfloat16", (4,)),
             ("bool", ()), ("float16", (1,)), ("int32", (2,)), ("float64", (0,))]
    pending = []
    for i, (dtype, trailing) in enumerate(specs):
        tag = f"a2a.many.{i}"
        splits = [a2a_splits(tag, k) for k in range(SIZE)]
        inputs = [a2a_input(tag, k, dtype, splits[k], trailing) for k in range(SIZE)]
        h = attempt(lambda: hvd.alltoall_async(inputs[RANK], splits[RANK],
                                               name=tag if i % 3 else None))
        pending.append((tag, h, a2a_expected(inputs, splits, RANK)))
    xs, exp = sum_ints()
    h_ar = attempt(lambda: hvd.allreduce_async(xs[RANK], op=hvd.Sum, name="a2a.many.ar"))
    got_ar = finish(h_ar)
    results = [(tag, finish(h), want) for tag, h, want in reversed(pending)]
    for tag, got, want in results:
        check_a2a(tag, got, want)
    check_array("allreduce in flight with them", got_ar, exp)


@case("alltoall.splits_none_not_divisible")
def a2a_not_divisible():
    x = np.zeros((SIZE + 1, 2), np.float32)
    out = attempt(lambda: hvd.alltoall(x, name="a2a.notdiv"))
    out_a = attempt(lambda: hvd.alltoall_async(x, name="a2a.notdiv.a"))
    check = a2a_follow_up("a2a.notdiv")
    raised(out, ValueError, "divisible", str(SIZE + 1))
    raised(out_a, ValueError, "divisible")
    check()


@case("alltoall.bad_splits")
def a2a_bad_splits():
    rows = 2 * SIZE
    x = np.arange(rows, dtype=np.int32)
    bad = {"too_short": [rows] + [0] * (SIZE - 2), "too_long": [2] * SIZE + [0],
           "negative": [rows + 1, -1] + [0] * (SIZE - 2), "wrong_sum": [3] * SIZE,
           "not_integers": ["a"] * SIZE}
    outs = {k: attempt(lambda v=v, k=k: hvd.alltoall(x, splits=v, name=f"a2a.bad.{k}"))
            for k, v in bad.items()}
    outs["async_wrong_sum"] = attempt(lambda: hvd.alltoall_async(x, [1] * SIZE,
                                                                 name="a2a.bad.async"))
    check = a2a_follow_up("a2a.bad.wrong_sum")
    for k, out in outs.items():
        labelled(k, raised, out, ValueError, "splits")
    check()


@case("alltoall.scalar_raises")
def a2a_scalar():
    out = attempt(lambda: hvd.alltoall(np.float32(3.0), name="a2a.scalar"))
    out0d = attempt(lambda: hvd.alltoall(np.array(3, np.int64), name="a2a.scalar0d"))
    check = a2a_follow_up("a2a.scalar")
    raised(out, ValueError, "scalar")
    raised(out0d, ValueError, "scalar")
    check()


@case("alltoall.mismatch_trailing_shape")
def a2a_mismatch_trailing():
    trailing = (4,) if RANK == LAST else (3,)
    out = attempt(lambda: hvd.alltoall(np.ones((SIZE,) + trailing), name="a2a.mm.trail"))
    check = a2a_follow_up("a2a.mm.trail")
    mismatch(out, "a2a.mm.trail", LAST, "(3,)", "(4,)")
    check()


@case("alltoall.mismatch_ndim")
def a2a_mismatch_ndim():
    shape = (SIZE, 2, 1) if RANK == LAST else (SIZE, 2)
    out = attempt(lambda: hvd.alltoall(np.ones(shape, np.int8), name="a2a.mm.ndim"))
    check = a2a_follow_up("a2a.mm.ndim")
    mismatch(out, "a2a.mm.ndim", LAST)
    check()


@case("alltoall.mismatch_dtype")
def a2a_mismatch_dtype():
    dt = np.float64 if RANK == 0 else np.float32
    out = attempt(lambda: hvd.alltoall(np.ones((SIZE, 2), dt), name="a2a.mm.dtype"))
    check = a2a_follow_up("a2a.mm.dtype")
    mismatch(out, "a2a.mm.dtype", 0, "float32", "float64")
    check()


@case("alltoall.mismatch_after_cached")
def a2a_mismatch_after_cached():
    """A name that ran fine twice (so it is cached) then gets a wrong trailing shape on one
    rank: the error reaches everyone, and the name works again afterwards."""
    name = "a2a.mm.cached"
    ok = [a2a_follow_up(name) for _ in range(2)]
    trailing = (3,) if RANK == LAST else (2,)
    out = attempt(lambda: hvd.alltoall(np.ones((SIZE,) + trailing, np.int32), name=name))
    check = a2a_follow_up(name)
    for c in ok:
        c()
    mismatch(out, name, LAST)
    check()


# --- reducescatter -----------------------------------------------------------------------------
def rs_run(name: str, inputs: list[np.ndarray], dtype: str, op: str, pre=1.0, post=1.0):
    """Issue sync + async reducescatter; return a check against the reference."""
    x = inputs[RANK]
    before = x.copy()
    kw = dict(op=OP[op], prescale_factor=pre, postscale_factor=post)
    h = attempt(lambda: hvd.reducescatter_async(x, name=name + ".a", **kw))
    sync = attempt(lambda: hvd.reducescatter(x, name=name, **kw))
    got_a = finish(h)

    def check():
        exp = row_slice(allreduce_expected(inputs, dtype, op, SIZE, pre, post),
                        x.shape[0], RANK)
        check_array(f"{name} sync", sync, exp)
        check_array(f"{name} async", got_a, exp)
        assert np.array_equal(x, before), "reducescatter changed its input"
    return check


def rs_op_dtype_case(name: str, op: str, dtype: str) -> None:
    shape = (2 * SIZE + 1, 3)
    inputs = [cc.op_input(name, k, dtype, op, shape) for k in range(SIZE)]
    rs_run(name, inputs, dtype, op)()


for _op in cc.OPS:
    for _dt in cc.DTYPES:
        if not (_dt == "bool" and _op == "Average"):
            _name = f"reducescatter.{_op}.{_dt}"
            register(_name, functools.partial(rs_op_dtype_case, _name, _op, _dt))

RS_ROWS = {"zero": lambda n: 0, "one": lambda n: 1, "n_minus_1": lambda n: n - 1,
           "n": lambda n: n, "n_plus_1": lambda n: n + 1, "2n_minus_1": lambda n: 2 * n - 1,
           "3n_plus_2": lambda n: 3 * n + 2}


def rs_rows_case(name: str, key: str) -> None:
    """R rows over N ranks (R < N leaves some ranks without rows): 3-D, 1-D and 2-D inputs."""
    rows = RS_ROWS[key](SIZE)
    specs = [("Sum", "int64", (rows, 2, 2)), ("Average", "float32", (rows,)),
             ("Max", "int8", (rows, 3)), ("Min", "float16", (rows, 1, 2))]
    checks = []
    for i, (op, dtype, shape) in enumerate(specs):
        tag = f"{name}.{i}"
        inputs = [cc.op_input(tag, k, dtype, op, shape) for k in range(SIZE)]
        checks.append(rs_run(tag, inputs, dtype, op))
    for c in checks:
        c()
    want_rows = rows_of(rows, SIZE)
    assert sum(want_rows) == rows and max(want_rows) - min(want_rows) <= 1


for _key in RS_ROWS:
    _name = f"reducescatter.rows.{_key}"
    register(_name, functools.partial(rs_rows_case, _name, _key))

RS_SCALED_DTYPES = ["int32", "uint8", "int64", "float16", "bfloat16", "float32", "float64"]


def rs_scaled_case(name: str, op: str, dtype: str) -> None:
    shape = (SIZE + 2, 2)
    inputs = [small_int_input(name, k, dtype, op, shape) for k in range(SIZE)]
    checks = [rs_run(f"{name}.{i}", inputs, dtype, op, pre, post)
              for i, (pre, post) in enumerate(cc.SCALE_FACTORS)]
    for c in checks:
        c()


for _op in cc.OPS:
    for _dt in RS_SCALED_DTYPES:
        _name = f"reducescatter.scaled.{_op}.{_dt}"
        register(_name, functools.partial(rs_scaled_case, _name, _op, _dt))


@case("reducescatter.default_op_is_average")
def rs_default_average():
    xs = [np.full((SIZE, 2), float(k + 1)) for k in range(SIZE)]
    got = attempt(lambda: hvd.reducescatter(xs[RANK], name="rs.default"))
    want = sum(range(1, SIZE + 1)) / SIZE
    check_array("default op", got, Expected("float64", ref64=np.full((1, 2), want),
                                            tol=np.full((1, 2), 1e-12)))


@case("reducescatter.noncontiguous_input")
def rs_noncontiguous():
    shape = (SIZE + 1, 3)
    inputs = [cc.op_input("rs.nc", k, "float64", "Sum", shape) for k in range(SIZE)]
    view = np.asfortranarray(inputs[RANK])
    assert not view.flags.c_contiguous
    got = attempt(lambda: hvd.reducescatter(view, op=hvd.Sum, name="rs.nc"))
    check_array("noncontiguous", got, row_slice(
        allreduce_expected(inputs, "float64", "Sum", SIZE), shape[0], RANK))


@case("reducescatter.repeated_named")
def rs_repeated():
    """Same name every step; values change every step, shape at step 3, op at step 5."""
    results = []
    for step in range(8):
        shape = (SIZE + 1, 2) if step < 3 else (2 * SIZE + 3, 2)
        op = "Sum" if step < 5 else "Max"
        inputs = [cc.op_input(f"rs.rep.{step}", k, "int32", op, shape) for k in range(SIZE)]
        got = attempt(lambda: hvd.reducescatter(inputs[RANK], op=OP[op], name="rs.rep"))
        results.append((step, got, row_slice(allreduce_expected(inputs, "int32", op, SIZE),
                                             shape[0], RANK)))
    for step, got, exp in results:
        check_array(f"step {step}", got, exp)


@case("reducescatter.many_async_in_flight")
def rs_many_async():
    specs = [("Sum", "float32", (SIZE - 1, 4)), ("Max", "int16", (3 * SIZE,)),
             ("Average", "float64", (SIZE + 1, 2, 2)), ("Product", "int32", (1, 5)),
             ("Min", "bfloat16", (SIZE + 3,))]
    pending = []
    for i, (op, dtype, shape) in enumerate(specs):
        tag = f"rs.many.{i}"
        inputs = [cc.op_input(tag, k, dtype, op, shape) for k in range(SIZE)]
        h = attempt(lambda: hvd.reducescatter_async(inputs[RANK], op=OP[op],
                                                    name=tag if i != 3 else None))
        pending.append((tag, h, row_slice(allreduce_expected(inputs, dtype, op, SIZE),
                                          shape[0], RANK)))
    results = [(tag, finish(h), exp) for tag, h, exp in reversed(pending)]
    for tag, got, exp in results:
        check_array(tag, got, exp)


@case("reducescatter.local_argument_errors")
def rs_local_errors():
    x = np.ones((SIZE, 2), np.float32)
    adasum = attempt(lambda: hvd.reducescatter(x, op=hvd.Adasum, name="rs.adasum"))
    adasum_a = attempt(lambda: hvd.reducescatter_async(x, op=hvd.Adasum, name="rs.adasum.a"))
    scalar = attempt(lambda: hvd.reducescatter(np.float32(1.0), op=hvd.Sum, name="rs.scalar"))
    bool_avg = attempt(lambda: hvd.reducescatter(np.ones((SIZE,), bool), name="rs.boolavg"))
    bad_op = attempt(lambda: hvd.reducescatter(x, op=17, name="rs.badop"))
    check = follow_up_allreduce("rs.adasum")
    raised(adasum, ValueError, "Adasum", "rs.adasum")
    raised(adasum_a, ValueError, "Adasum")
    raised(scalar, ValueError, "scalar")
    raised(bool_avg, hvd.UnsupportedDtypeError, "bool")
    raised(bad_op, ValueError)
    check()


def rs_follow_up(name: str):
    inputs = [cc.op_input(name + ".ok", k, "int32", "Sum", (SIZE + 1, 2)) for k in range(SIZE)]
    got = attempt(lambda: hvd.reducescatter(inputs[RANK], op=hvd.Sum, name=name))
    exp = row_slice(allreduce_expected(inputs, "int32", "Sum", SIZE), SIZE + 1, RANK)
    return lambda: check_array(f"follow-up reducescatter {name!r}", got, exp)


@case("reducescatter.mismatch_rows")
def rs_mismatch_rows():
    shape = (SIZE + 1, 2) if RANK == LAST else (SIZE, 2)
    out = attempt(lambda: hvd.reducescatter(np.ones(shape), op=hvd.Sum, name="rs.mm.rows"))
    check = rs_follow_up("rs.mm.rows")
    mismatch(out, "rs.mm.rows", LAST, "shape")
    check()


@case("reducescatter.mismatch_trailing_shape")
def rs_mismatch_trailing():
    shape = (SIZE, 3) if RANK == 0 else (SIZE, 2)
    out = attempt(lambda: hvd.reducescatter(np.ones(shape, np.int32), op=hvd.Sum,
                                            name="rs.mm.trail"))
    check = rs_follow_up("rs.mm.trail")
    mismatch(out, "rs.mm.trail", 0, "shape")
    check()


@case("reducescatter.mismatch_op")
def rs_mismatch_op():
    op = hvd.Max if RANK == LAST else hvd.Sum
    out = attempt(lambda: hvd.reducescatter(np.ones((SIZE, 2)), op=op, name="rs.mm.op"))
    check = rs_follow_up("rs.mm.op")
    mismatch(out, "rs.mm.op", LAST, "Sum", "Max")
    check()


@case("reducescatter.mismatch_after_cached")
def rs_mismatch_after_cached():
    name = "rs.mm.cached"
    ok = [rs_follow_up(name) for _ in range(2)]
    shape = (SIZE + 2, 2) if RANK == LAST else (SIZE + 1, 2)
    out = attempt(lambda: hvd.reducescatter(np.ones(shape, np.int32), op=hvd.Sum, name=name))
    check = rs_follow_up(name)
    for c in ok:
        c()
    mismatch(out, name, LAST, "shape")
    check()


# --- grouped operations ------------------------------------------------------------------------
GROUP_SPECS = [("int32", (5,)), ("float32", (2, 3)), ("float64", ()), ("int8", (4,)),
               ("float16", (3,)), ("bfloat16", (2,)), ("uint8", (0,)), ("int64", (2, 2, 2))]


def group_inputs(tag: str, op: str, specs=GROUP_SPECS, scaled=False) -> list[list[np.ndarray]]:
    """inputs[member][rank]"""
    make = small_int_input if scaled else cc.op_input
    return [[make(f"{tag}.{i}", k, dtype, op, shape) for k in range(SIZE)]
            for i, (dtype, shape) in enumerate(specs)]


def group_expected(inputs, op: str, specs=GROUP_SPECS, pre=1.0, post=1.0) -> list[Expected]:
    return [allreduce_expected(inputs[i], dtype, op, SIZE, pre, post)
            for i, (dtype, _) in enumerate(specs)]


def check_group(label: str, got, exps: list[Expected]) -> None:
    if isinstance(got, BaseException):
        raise AssertionError(f"{label}: raised {type(got).__name__}: {got}")
    assert isinstance(got, list) and len(got) == len(exps), f"{label}: got {got!r}"
    for i, (g, e) in enumerate(zip(got, exps)):
        check_array(f"{label} member {i}", g, e)


def grouped_allreduce_case(name: str, op: str) -> None:
    """Mixed dtypes and shapes in one group: out of place, in place, async, async in place,
    unnamed."""
    inputs = group_inputs(name, op)
    mine = [member[RANK] for member in inputs]
    before = [m.copy() for m in mine]
    inplace = [m.copy() for m in mine]
    inplace_a = [m.copy() for m in mine]
    kw = dict(op=OP[op])
    gh = attempt(lambda: hvd.grouped_allreduce_async(mine, name=name + ".a", **kw))
    gh_ = attempt(lambda: hvd.grouped_allreduce_async_(inplace_a, name=name + ".a_", **kw))
    sync = attempt(lambda: hvd.grouped_allreduce(mine, name=name, **kw))
    ret_inplace = attempt(lambda: hvd.grouped_allreduce_(inplace, name=name + "_", **kw))
    unnamed = attempt(lambda: hvd.grouped_allreduce(mine, **kw))
    got_a = finish(gh)
    ret_a_ = finish(gh_)
    exps = group_expected(inputs, op)
    check_group("sync", sync, exps)
    check_group("async", got_a, exps)
    check_group("unnamed", unnamed, exps)
    check_group("in place (arrays)", inplace, exps)
    check_group("async in place (arrays)", inplace_a, exps)
    for label, ret, arrays in (("in place", ret_inplace, inplace),
                               ("async in place", ret_a_, inplace_a)):
        if isinstance(ret, BaseException):
            raise AssertionError(f"{label}: raised {ret!r}")
        assert all(r is a for r, a in zip(ret, arrays)), f"{label}: did not return its arrays"
    for m, b in zip(mine, before):
        assert np.array_equal(m, b), "out-of-place grouped allreduce changed an input"


for _op in cc.OPS:
    _name = f"grouped_allreduce.{_op}"
    register(_name, functools.partial(grouped_allreduce_case, _name, _op))


@case("grouped_allreduce.bool_members")
def grouped_bool():
    specs = [("bool", (6,)), ("int16", (3,)), ("bool", (2, 2))]
    results = []
    for op in ("Sum", "Min", "Max", "Product"):
        inputs = group_inputs(f"g.bool.{op}", op, specs)
        got = attempt(lambda: hvd.grouped_allreduce([m[RANK] for m in inputs], op=OP[op],
                                                    name=f"g.bool.{op}"))
        results.append((op, got, group_expected(inputs, op, specs)))
    for op, got, exps in results:
        check_group(op, got, exps)


@case("grouped_allreduce.scaled")
def grouped_scaled():
    specs = [("int32", (4,)), ("float32", (3,)), ("uint8", (2,)), ("float16", (2, 2)),
             ("float64", (5,))]
    results = []
    for op in ("Sum", "Average", "Max"):
        inputs = group_inputs(f"g.scaled.{op}", op, specs, scaled=True)
        for i, (pre, post) in enumerate(cc.SCALE_FACTORS):
            got = attempt(lambda: hvd.grouped_allreduce(
                [m[RANK] for m in inputs], op=OP[op], prescale_factor=pre,
                postscale_factor=post, name=f"g.scaled.{op}.{i}"))
            results.append((f"{op} pre={pre} post={post}", got,
                            group_expected(inputs, op, specs, pre, post)))
    for label, got, exps in results:
        check_group(label, got, exps)


@case("grouped_allreduce.legacy_average_flag")
def grouped_legacy_average():
    specs = [("float64", (3,)), ("float32", (2,))]
    inputs = group_inputs("g.laf", "Sum", specs)
    mine = [m[RANK] for m in inputs]
    avg = attempt(lambda: hvd.grouped_allreduce(mine, average=True, name="g.laf.t"))
    sm = attempt(lambda: hvd.grouped_allreduce(mine, average=False, name="g.laf.f"))
    check_group("average=True", avg, group_expected(inputs, "Average", specs))
    check_group("average=False", sm, group_expected(inputs, "Sum", specs))


@case("grouped_allreduce.freed_without_cyclic_gc")
def grouped_freed_without_gc():
    """Once a grouped op finished and the caller dropped its arrays, the engine must hold no
    reference to them: freed by reference counting alone (a training loop gets its results'
    warm memory back every step).  Checked with the cyclic collector off."""
    import gc
    import weakref
    gc.collect()
    gc.disable()
    try:
        inputs = [np.full(n, RANK + 1.0, dtype=np.float32) for n in (300_000, 5, 70_000)]
        results = hvd.grouped_allreduce(inputs, op=hvd.Sum, name="g.freed")
        expected = float(sum(range(1, SIZE + 1)))
        assert all(np.all(r == expected) for r in results), results
        refs = [weakref.ref(a) for a in inputs + results]
        del inputs, results
        for i in range(2):   # the background thread's own locals move on to these
            hvd.allreduce(np.zeros(1), name=f"g.freed.after{i}")
        alive = [i for i, ref in enumerate(refs) if ref() is not None]
        assert not alive, f"arrays {alive} of a finished group are still referenced"
    finally:
        gc.enable()


@case("allgather.varying_sizes_reuse_pooled_memory")
def allgather_varying_sizes():
    """An allgather whose total rows change a little every step (a sparse gradient's nonzero
    rows) gets its result from the pool's warm memory after the first step, not fresh pages."""
    from hvdlite.common.memory import result_pool
    pool = result_pool()
    rows = [70_000 + 37 * ((step * 7 + RANK) % 11) for step in range(12)]   # ~280 KiB each
    misses = None
    for step, n in enumerate(rows):
        if step == 2:
            misses = pool.misses
        got = hvd.allgather(np.full(n, float(RANK), dtype=np.float32), name="ag.vary")
        want = np.concatenate([np.full(70_000 + 37 * ((step * 7 + r) % 11), float(r),
                                       dtype=np.float32) for r in range(SIZE)])
        check_exact(f"step {step}", got, want)
        del got
    assert pool.misses == misses, f"{pool.misses - misses} of 10 steps needed fresh memory"


@case("grouped_allreduce.repeated_named")
def grouped_repeated():
    """One name every step (steady state through the cache); values change every step, one
    member's shape at step 4, the op at step 6."""
    results = []
    for step in range(9):
        specs = [("float32", (3,)), ("int32", (2, 2) if step < 4 else (5,)), ("float64", (1,))]
        op = "Sum" if step < 6 else "Min"
        inputs = group_inputs(f"g.rep.{step}", op, specs)
        got = attempt(lambda: hvd.grouped_allreduce([m[RANK] for m in inputs], op=OP[op],
                                                    name="g.rep"))
        single = attempt(lambda: hvd.grouped_allreduce([inputs[0][RANK]], op=OP[op],
                                                       name="g.rep.single"))
        results.append((step, got, group_expected(inputs, op, specs), single,
                        group_expected(inputs[:1], op, specs[:1])))
    for step, got, exps, single, exp1 in results:
        check_group(f"step {step}", got, exps)
        check_group(f"step {step} (one-member group)", single, exp1)


@case("grouped_allreduce.one_request_per_group")
def grouped_one_request():
    """A named group is negotiated as one request: 60 members take one response-cache slot,
    and every later step of the same group is one cached slot again, with correct results."""
    from hvdlite.common.runtime import state
    cache = state.engine().controller.cache
    specs = [("float32", (16,)), ("int32", (3, 2)), ("float64", (5,))] * 20
    before = len(cache)
    results = []
    for step in range(4):
        inputs = group_inputs(f"g.one.{step}", "Sum", specs)
        got = attempt(lambda: hvd.grouped_allreduce([m[RANK] for m in inputs], op=hvd.Sum,
                                                    name="g.one"))
        results.append((step, got, group_expected(inputs, "Sum", specs)))
    grown = len(cache) - before
    for step, got, exps in results:
        check_group(f"step {step}", got, exps)
    assert grown == 1, f"a 60-member group took {grown} response-cache slots, not 1"


@case("grouped_allreduce.reused_group_new_arrays")
def grouped_new_arrays():
    """The same named group every step with new arrays of the same shapes (its entries are
    reused): in place, each step's own arrays get the result and earlier ones stay as they
    were; out of place, each step's results are new arrays and earlier ones keep their values."""
    specs = [("float32", (7,)), ("int64", (2, 3)), ("float32", (1,))]
    in_place, kept, outs = [], [], []
    for step in range(4):
        inputs = group_inputs(f"g.new.{step}", "Sum", specs)
        mine = [m[RANK].copy() for m in inputs]
        ret = attempt(lambda: hvd.grouped_allreduce_(mine, op=hvd.Sum, name="g.new_"))
        got = attempt(lambda: hvd.grouped_allreduce([m[RANK] for m in inputs], op=hvd.Sum,
                                                    name="g.new"))
        exps = group_expected(inputs, "Sum", specs)
        in_place.append((step, ret, mine, exps))
        outs.append((step, got, exps))
        kept.append([np.array(a, copy=True) for a in mine])
    for step, ret, mine, exps in in_place:
        if isinstance(ret, BaseException):
            raise AssertionError(f"step {step} in place: raised {ret!r}")
        assert all(r is a for r, a in zip(ret, mine)), f"step {step}: not its own arrays back"
        check_group(f"step {step} in place", mine, exps)
        for i, (a, k) in enumerate(zip(mine, kept[step])):
            check_exact(f"step {step} member {i} untouched by later steps", a, k)
    seen = set()
    for step, got, exps in outs:
        check_group(f"step {step} out of place (after later steps)", got, exps)
        for g in got:
            assert id(g) not in seen, f"step {step}: a result array was handed out twice"
            seen.add(id(g))


@case("grouped_allreduce.member_name_also_in_flight")
def grouped_member_name_in_flight():
    """A plain allreduce named like a group's member may be in flight with the group (the
    group is one operation under its own name); both complete with their own results."""
    specs = [("float32", (4,)), ("float32", (3,))]
    inputs = group_inputs("g.mnif", "Sum", specs)
    plain = [cc.op_input("g.mnif.plain", k, "float64", "Sum", (6,)) for k in range(SIZE)]
    h = attempt(lambda: hvd.allreduce_async(plain[RANK], op=hvd.Sum, name="g.mnif.0"))
    gh = attempt(lambda: hvd.grouped_allreduce_async([m[RANK] for m in inputs], op=hvd.Sum,
                                                     name="g.mnif"))
    got_group = finish(gh)
    got_plain = finish(h)
    check_group("group", got_group, group_expected(inputs, "Sum", specs))
    check_array("plain allreduce under a member's name", got_plain,
                allreduce_expected(plain, "float64", "Sum", SIZE))


@case("grouped_allreduce.duplicate_group_in_flight")
def grouped_duplicate_in_flight():
    """The same group name twice in flight on every rank: the second submission raises
    DuplicateNameError naming the group, and the first completes."""
    specs = [("float32", (4,)), ("int32", (2,))]
    inputs = group_inputs("g.dup", "Sum", specs)
    mine = [m[RANK] for m in inputs]
    first = attempt(lambda: hvd.grouped_allreduce_async(mine, op=hvd.Sum, name="g.dup"))
    second = attempt(lambda: hvd.grouped_allreduce_async(mine, op=hvd.Sum, name="g.dup"))
    got = finish(first)
    raised(second, hvd.DuplicateNameError, "g.dup")
    check_group("first submission", got, group_expected(inputs, "Sum", specs))


@case("grouped.empty_list")
def grouped_empty():
    outs = {
        "grouped_allreduce": attempt(lambda: hvd.grouped_allreduce([], name="g.empty")),
        "grouped_allreduce_": attempt(lambda: hvd.grouped_allreduce_([])),
        "grouped_allgather": attempt(lambda: hvd.grouped_allgather([])),
        "grouped_reducescatter": attempt(lambda: hvd.grouped_reducescatter([])),
    }
    gh = attempt(lambda: hvd.grouped_allreduce_async([]))
    outs["grouped_allreduce_async"] = finish(gh)
    outs["grouped_allgather_async"] = finish(attempt(lambda: hvd.grouped_allgather_async([])))
    outs["grouped_reducescatter_async"] = finish(attempt(
        lambda: hvd.grouped_reducescatter_async([])))
    check = follow_up_allreduce("g.empty.after")
    for k, v in outs.items():
        assert isinstance(v, list) and v == [], f"{k}([]) returned {v!r}"
    assert gh.poll(), "empty group handle does not poll as done"
    check()


def group_errors(gh, n: int) -> list:
    """Each member's outcome (and the group's own wait) of a grouped handle."""
    if isinstance(gh, BaseException):
        return [gh] * (n + 1)
    return [attempt(h.wait) for h in gh.handles] + [attempt(gh.wait)]


def check_member_errors(outcomes: list, bad: str, odd: int) -> None:
    for i, out in enumerate(outcomes):
        label = "the group's wait()" if i == len(outcomes) - 1 else f"member {i}"
        if not isinstance(out, hvd.TensorMismatchError):
            raise AssertionError(f"{label}: expected TensorMismatchError, got {out!r}")
        msg = str(out)
        assert bad in msg, f"{label}: message does not name the bad member {bad!r}: {msg}"
        assert str([odd]) in msg, f"{label}: message does not name rank {odd}: {msg}"


def grouped_follow_up(name: str, specs):
    inputs = group_inputs(name + ".ok", "Sum", specs)
    got = attempt(lambda: hvd.grouped_allreduce([m[RANK] for m in inputs], op=hvd.Sum,
                                                name=name))
    exps = group_expected(inputs, "Sum", specs)
    return lambda: check_group(f"follow-up group {name!r}", got, exps)


@case("grouped_allreduce.mismatch_one_member")
def grouped_mismatch():
    specs = [("float32", (3,)), ("int32", (4,)), ("float64", (2,))]
    arrays = [np.ones(s, cc.np_dtype(d)) for d, s in specs]
    if RANK == LAST:
        arrays[1] = np.ones(5, np.int32)
    gh = attempt(lambda: hvd.grouped_allreduce_async(arrays, op=hvd.Sum, name="g.mm"))
    outcomes = group_errors(gh, len(arrays))
    check = grouped_follow_up("g.mm", specs)
    check_member_errors(outcomes, "g.mm.1", LAST)
    check()


@case("grouped_allreduce.mismatch_after_cached")
def grouped_mismatch_cached():
    specs = [("float32", (3,)), ("int32", (4,)), ("float64", (2,))]
    ok = [grouped_follow_up("g.mmc", specs) for _ in range(2)]
    arrays = [np.ones(s, cc.np_dtype(d)) for d, s in specs]
    if RANK == 0:
        arrays[2] = np.ones(2, np.float32)   # dtype differs on the coordinator
    outcomes = group_errors(attempt(lambda: hvd.grouped_allreduce_async(
        arrays, op=hvd.Sum, name="g.mmc")), len(arrays))
    check = grouped_follow_up("g.mmc", specs)
    for c in ok:
        c()
    check_member_errors(outcomes, "g.mmc.2", 0)
    check()


GATHER_SPECS = [("int32", (3,)), ("float16", (2,)), ("bool", None), ("bfloat16", ()),
                ("float64", (2, 2)), ("uint8", (0,))]


def gather_member(tag: str, rank: int, dtype: str, row, rows_shift: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: rows differ per rank (rank 1 has none); ``row=None`` -> 0-d."""
    if row is None:
        return cc.op_input(tag, rank, dtype, "Sum", ())
    rows = 0 if rank == 1 else rank + 1 + rows_shift
    return cc.op_input(tag, rank, dtype, "Sum", (rows,) + row)


def gather_expected(inputs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([x.reshape(1) if x.ndim == 0 else x for x in inputs])


def grouped_allgather_step(name: str, tag: str, rows_shift: int = 0):
    inputs = [[gather_member(f"{tag}.{i}", k, d, row, rows_shift) for k in range(SIZE)]
              for i, (d, row) in enumerate(GATHER_SPECS)]
    mine = [m[RANK] for m in inputs]
    got = attempt(lambda: hvd.grouped_allgather(mine, name=name))
    return got, [gather_expected(m) for m in inputs]


def check_gathered(label: str, got, wants: list[np.ndarray]) -> None:
    if isinstance(got, BaseException):
        raise AssertionError(f"{label}: raised {type(got).__name__}: {got}")
    assert isinstance(got, list) and len(got) == len(wants), f"{label}: got {got!r}"
    for i, (g, w) in enumerate(zip(got, wants)):
        check_exact(f"{label} member {i}", g, w)


@case("grouped_allgather.mixed_members")
def grouped_allgather_mixed():
    inputs = [[gather_member(f"gag.a.{i}", k, d, row) for k in range(SIZE)]
              for i, (d, row) in enumerate(GATHER_SPECS)]
    mine = [m[RANK] for m in inputs]
    gh = attempt(lambda: hvd.grouped_allgather_async(mine, name="gag.async"))
    sync, wants = grouped_allgather_step("gag.sync", "gag.a")
    unnamed = attempt(lambda: hvd.grouped_allgather(mine))
    got_a = finish(gh)
    check_gathered("sync", sync, wants)
    check_gathered("async", got_a, wants)
    check_gathered("unnamed", unnamed, wants)


@case("grouped_allgather.repeated_named")
def grouped_allgather_repeated():
    results = [(step, *grouped_allgather_step("gag.rep", f"gag.rep.{step}", step // 2))
               for step in range(5)]
    for step, got, wants in results:
        check_gathered(f"step {step}", got, wants)


@case("grouped_allgather.mismatch_one_member")
def grouped_allgather_mismatch():
    arrays = [np.ones((2, 3), np.float32), np.ones((RANK + 1, 2), np.int16)]
    if RANK == LAST:
        arrays[0] = np.ones((2, 4), np.float32)
    outcomes = group_errors(attempt(lambda: hvd.grouped_allgather_async(arrays, name="gag.mm")),
                            len(arrays))
    got, wants = grouped_allgather_step("gag.mm", "gag.mm.ok")
    check_member_errors(outcomes, "gag.mm.0", LAST)
    check_gathered("follow-up", got, wants)


RS_GROUP_SPECS = [("int32", lambda n: (n + 1, 2)), ("float32", lambda n: (1,)),
                  ("float64", lambda n: (2 * n, 2, 1)), ("int8", lambda n: (n - 1, 3)),
                  ("bfloat16", lambda n: (3 * n + 1,))]


def grouped_rs_step(name: str, tag: str, op: str, pre=1.0, post=1.0):
    shapes = [(d, f(SIZE)) for d, f in RS_GROUP_SPECS]
    inputs = group_inputs(tag, op, shapes, scaled=(pre, post) != (1.0, 1.0))
    got = attempt(lambda: hvd.grouped_reducescatter(
        [m[RANK] for m in inputs], op=OP[op], prescale_factor=pre, postscale_factor=post,
        name=name))
    exps = [row_slice(e, s[0], RANK) for e, (_, s) in
            zip(group_expected(inputs, op, shapes, pre, post), shapes)]
    return got, exps


def grouped_rs_case(name: str, op: str) -> None:
    """Mixed dtypes, uneven rows (one member with fewer rows than ranks), sync and async."""
    shapes = [(d, f(SIZE)) for d, f in RS_GROUP_SPECS]
    inputs = group_inputs(name + ".a", op, shapes)
    gh = attempt(lambda: hvd.grouped_reducescatter_async([m[RANK] for m in inputs], op=OP[op],
                                                         name=name + ".a"))
    got, exps = grouped_rs_step(name, name, op)
    got_a = finish(gh)
    exps_a = [row_slice(e, s[0], RANK) for e, (_, s) in
              zip(group_expected(inputs, op, shapes), shapes)]
    check_group("sync", got, exps)
    check_group("async", got_a, exps_a)


for _op in cc.OPS:
    _name = f"grouped_reducescatter.{_op}"
    register(_name, functools.partial(grouped_rs_case, _name, _op))


@case("grouped_reducescatter.scaled")
def grouped_rs_scaled():
    results = [(op, pre, post, *grouped_rs_step(f"grs.sc.{op}.{i}", f"grs.sc.{op}", op, pre,
                                                post))
               for op in ("Sum", "Average") for i, (pre, post) in enumerate(cc.SCALE_FACTORS)]
    for op, pre, post, got, exps in results:
        check_group(f"{op} pre={pre} post={post}", got, exps)


@case("grouped_reducescatter.repeated_named")
def grouped_rs_repeated():
    results = [(step, *grouped_rs_step("grs.rep", f"grs.rep.{step}", "Sum"))
               for step in range(5)]
    for step, got, exps in results:
        check_group(f"step {step}", got, exps)


@case("grouped_reducescatter.mismatch_one_member")
def grouped_rs_mismatch():
    arrays = [np.ones((SIZE, 2), np.float32), np.ones((SIZE + 1,), np.int32)]
    if RANK == LAST:
        arrays[1] = np.ones((SIZE + 2,), np.int32)
    outcomes = group_errors(attempt(lambda: hvd.grouped_reducescatter_async(
        arrays, op=hvd.Sum, name="grs.mm")), len(arrays))
    got, exps = grouped_rs_step("grs.mm", "grs.mm.ok", "Sum")
    check_member_errors(outcomes, "grs.mm.1", LAST)
    check_group("follow-up", got, exps)


def mpi_path_fused() -> int:
    """Fused allgather/reducescatter batches the MPI data path has run on this rank."""
    from hvdlite.common.runtime import registry
    return registry.process_set_engine(None, "test")[0].path("mpi").fused_gathers


@case("grouped.fused_same_dtype")
def grouped_fused_same_dtype():
    """Small members of one dtype run as one fused Allgatherv / Reduce_scatter: rows that
    differ per rank (none on rank 1), different row shapes, a 0-d member, fewer rows than
    ranks; exact results, Sum and scaled Average."""
    before = mpi_path_fused()
    rows = [(3,), None, (2, 2), (), (1,)]
    inputs = [[gather_member(f"gfu.ag.{i}", k, "float32", row) for k in range(SIZE)]
              for i, row in enumerate(rows)]
    gathered = attempt(lambda: hvd.grouped_allgather([m[RANK] for m in inputs],
                                                     name="gfu.ag"))
    check_gathered("fused allgather", gathered, [gather_expected(m) for m in inputs])
    shapes = [("int32", (2 * SIZE + 1, 2)), ("int32", (1,)), ("int32", (SIZE - 1, 3)),
              ("int32", (3 * SIZE,))]
    rs_inputs = group_inputs("gfu.rs", "Sum", shapes)
    got = attempt(lambda: hvd.grouped_reducescatter([m[RANK] for m in rs_inputs], op=hvd.Sum,
                                                    name="gfu.rs"))
    check_group("fused reducescatter Sum", got, [
        row_slice(e, s[0], RANK) for e, (_, s) in zip(group_expected(rs_inputs, "Sum", shapes),
                                                       shapes)])
    fshapes = [("float32", s) for _, s in shapes]
    f_inputs = group_inputs("gfu.rsf", "Average", fshapes, scaled=True)
    got = attempt(lambda: hvd.grouped_reducescatter(
        [m[RANK] for m in f_inputs], op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0,
        name="gfu.rsf"))
    check_group("fused reducescatter Average, scaled", got, [
        row_slice(e, s[0], RANK) for e, (_, s) in zip(
            group_expected(f_inputs, "Average", fshapes, 0.5, 3.0), fshapes)])
    ran = mpi_path_fused() - before
    assert ran == 3, f"rank {RANK}: {ran} fused batches on the MPI path, expected 3"


@case("grouped.mixed_kinds_in_flight")
def grouped_mixed_in_flight():
    """Grouped allreduce/allgather/reducescatter, a plain allreduce and an alltoall, all in
    flight together, waited in reverse order."""
    ar_inputs = group_inputs("gmix.ar", "Sum")
    ag_inputs = [[gather_member(f"gmix.ag.{i}", k, d, row) for k in range(SIZE)]
                 for i, (d, row) in enumerate(GATHER_SPECS)]
    rs_shapes = [(d, f(SIZE)) for d, f in RS_GROUP_SPECS]
    rs_inputs = group_inputs("gmix.rs", "Max", rs_shapes)
    splits = [a2a_splits("gmix.a2a", k) for k in range(SIZE)]
    a2a_inputs = [a2a_input("gmix.a2a", k, "int16", splits[k], (2,)) for k in range(SIZE)]
    xs, exp_sum = sum_ints()
    handles = [
        attempt(lambda: hvd.grouped_allreduce_async([m[RANK] for m in ar_inputs], op=hvd.Sum,
                                                    name="gmix.ar")),
        attempt(lambda: hvd.grouped_allgather_async([m[RANK] for m in ag_inputs],
                                                    name="gmix.ag")),
        attempt(lambda: hvd.allreduce_async(xs[RANK], op=hvd.Sum, name="gmix.plain")),
        attempt(lambda: hvd.grouped_reducescatter_async([m[RANK] for m in rs_inputs],
                                                        op=hvd.Max, name="gmix.rs")),
        attempt(lambda: hvd.alltoall_async(a2a_inputs[RANK], splits[RANK], name="gmix.a2a")),
    ]
    got = [finish(h) for h in reversed(handles)][::-1]
    check_group("grouped allreduce", got[0], group_expected(ar_inputs, "Sum"))
    check_gathered("grouped allgather", got[1], [gather_expected(m) for m in ag_inputs])
    check_array("plain allreduce", got[2], exp_sum)
    check_group("grouped reducescatter", got[3], [
        row_slice(e, s[0], RANK)
        for e, (_, s) in zip(group_expected(rs_inputs, "Max", rs_shapes), rs_shapes)])
    check_a2a("alltoall", got[4], a2a_expected(a2a_inputs, splits, RANK))


# --- Adasum through the engine -----------------------------------------------------------------
def adasum_inputs(tag: str, dtype: str, shape: tuple) -> list[np.ndarray]:
    """Correlated across ranks (so the coefficients are far from 1), per-rank scale."""
    n = int(np.prod(shape, dtype=np.int64))
    common = cc.rng_for(tag, 1000).standard_normal(n)
    return [((0.8 * common + 0.6 * cc.rng_for(tag, k).standard_normal(n)) * (1 + 0.5 * k))
            .reshape(shape).astype(dtype) for k in range(SIZE)]


def adasum_expected(inputs: list[np.ndarray], pre=1.0, post=1.0) -> np.ndarray:
    dt = inputs[0].dtype
    scaled = [(x.reshape(-1) * dt.type(pre)).astype(dt) for x in inputs]
    out = adasum_tree(scaled)
    return (out * dt.type(post)).astype(dt).reshape(inputs[0].shape)


def check_adasum(label: str, got, want: np.ndarray) -> None:
    if isinstance(got, BaseException):
        raise AssertionError(f"{label}: raised {type(got).__name__}: {got}")
    try:
        check_close(got, want, want.dtype.name)
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from None


def adasum_single(tag: str, dtype: str) -> None:
    """One tensor (1-D and 2-D): sync, in place, async."""
    checks = []
    for shape in ((1000,), (10, 7)):
        name = f"{tag}.{shape}"
        inputs = adasum_inputs(name, dtype, shape)
        x = inputs[RANK]
        y = x.copy()
        h = attempt(lambda: hvd.allreduce_async(x, op=hvd.Adasum, name=name + ".a"))
        sync = attempt(lambda: hvd.allreduce(x, op=hvd.Adasum, name=name))
        ret = attempt(lambda: hvd.allreduce_(y, op=hvd.Adasum, name=name + "_"))
        got_a = finish(h)
        checks.append((shape, inputs, sync, ret, y, got_a))
    for shape, inputs, sync, ret, y, got_a in checks:
        want = adasum_expected(inputs)
        check_adasum(f"{shape} sync", sync, want)
        check_adasum(f"{shape} async", got_a, want)
        assert ret is y, f"allreduce_ returned {ret!r}"
        check_adasum(f"{shape} in place", y, want)


def adasum_fused(tag: str, dtype: str) -> None:
    """Several small tensors in flight together (fused into one buffer): each is Adasum'ed on
    its own, as if reduced alone; a Sum allreduce in flight with them is unaffected."""
    shapes = [(1,), (3,), (17,), (4, 4), (64,), (0,), (5,)]
    pending = []
    for i, shape in enumerate(shapes):
        name = f"{tag}.{i}"
        inputs = adasum_inputs(name, dtype, shape)
        pending.append((name, inputs, attempt(lambda: hvd.allreduce_async(
            inputs[RANK], op=hvd.Adasum, name=name))))
    xs = [np.full(4, k + 1, dtype) for k in range(SIZE)]
    h_sum = attempt(lambda: hvd.allreduce_async(xs[RANK], op=hvd.Sum, name=tag + ".sum"))
    results = [(name, inputs, finish(h)) for name, inputs, h in pending]
    got_sum = finish(h_sum)
    for name, inputs, got in results:
        check_adasum(name, got, adasum_expected(inputs))
    check_array("Sum in flight", got_sum, allreduce_expected(xs, dtype, "Sum", SIZE))


def adasum_scaled(tag: str, dtype: str) -> None:
    factors = [(0.5, 3.0), (2.0, 1.0), (1.0, 0.25)]
    results = []
    for i, (pre, post) in enumerate(factors):
        name = f"{tag}.{i}"
        inputs = adasum_inputs(name, dtype, (50,))
        small = [adasum_inputs(f"{name}.s{j}", dtype, (j + 2,)) for j in range(3)]
        kw = dict(op=hvd.Adasum, prescale_factor=pre, postscale_factor=post)
        hs = [attempt(lambda s=s, j=j: hvd.allreduce_async(s[RANK], name=f"{name}.s{j}", **kw))
              for j, s in enumerate(small)]
        got = attempt(lambda: hvd.allreduce(inputs[RANK], name=name, **kw))
        results.append((pre, post, inputs, got, small, [finish(h) for h in hs]))
    for pre, post, inputs, got, small, got_small in results:
        check_adasum(f"pre={pre} post={post}", got, adasum_expected(inputs, pre, post))
        for j, (s, g) in enumerate(zip(small, got_small)):
            check_adasum(f"pre={pre} post={post} fused #{j}", g, adasum_expected(s, pre, post))


def adasum_repeated(tag: str, dtype: str) -> None:
    results = []
    for step in range(4):
        inputs = adasum_inputs(f"{tag}.{step}", dtype, (33,))
        results.append((step, inputs, attempt(lambda: hvd.allreduce(
            inputs[RANK], op=hvd.Adasum, name=tag))))
    for step, inputs, got in results:
        check_adasum(f"step {step}", got, adasum_expected(inputs))


def adasum_grouped(tag: str, dtype: str) -> None:
    shapes = [(9,), (2, 3), (1,)]
    inputs = [adasum_inputs(f"{tag}.{i}", dtype, s) for i, s in enumerate(shapes)]
    got = attempt(lambda: hvd.grouped_allreduce([m[RANK] for m in inputs], op=hvd.Adasum,
                                                name=tag))
    if isinstance(got, BaseException):
        raise AssertionError(f"raised {got!r}")
    for i, (g, m) in enumerate(zip(got, inputs)):
        check_adasum(f"member {i}", g, adasum_expected(m))


for _dt in ("float32", "float64"):
    for _kind, _fn in (("single", adasum_single), ("fused_async", adasum_fused),
                       ("scaled", adasum_scaled), ("repeated_named", adasum_repeated),
                       ("grouped", adasum_grouped)):
        _name = f"adasum.{_dt}.{_kind}"
        register(_name, functools.partial(_fn, _name, _dt), when=pow2)


@case("adasum.integer_dtypes_unsupported")
def adasum_int():
    outs = {dt: attempt(lambda dt=dt: hvd.allreduce(np.ones(4, dt), op=hvd.Adasum,
                                                    name=f"ada.int.{dt}"))
            for dt in ("int32", "int64", "uint8", "bool")}
    outs["int32 async"] = attempt(lambda: hvd.allreduce_async(np.ones(4, np.int32),
                                                              op=hvd.Adasum, name="ada.int.a"))
    outs["int32 grouped"] = attempt(lambda: hvd.grouped_allreduce(
        [np.ones(4, np.int32), np.ones(2)], op=hvd.Adasum, name="ada.int.g"))
    check = follow_up_allreduce("ada.int.after")
    for k, out in outs.items():
        labelled(k, raised, out, hvd.UnsupportedDtypeError, "Adasum")
    check()


@case("adasum.non_power_of_two_raises", when=_not_pow2)
def adasum_not_pow2():
    x = np.ones(8, np.float32)
    outs = {
        "allreduce": attempt(lambda: hvd.allreduce(x, op=hvd.Adasum, name="ada.np2")),
        "allreduce_": attempt(lambda: hvd.allreduce_(x.copy(), op=hvd.Adasum, name="ada.np2_")),
        "async": attempt(lambda: hvd.allreduce_async(x, op=hvd.Adasum, name="ada.np2.a")),
        "grouped": attempt(lambda: hvd.grouped_allreduce([x, x[:2]], op=hvd.Adasum,
                                                         name="ada.np2.g")),
    }
    check = follow_up_allreduce("ada.np2")
    for k, out in outs.items():
        labelled(k, raised, out, ValueError, "power-of-two", str(SIZE))
    check()


# -----------------------------------------------------------------------------------------------
def main() -> None:
    global RANK, SIZE, LAST
    from tests.workers._report import Reporter
    hvd.init()
    RANK, SIZE = hvd.rank(), hvd.size()
    LAST = SIZE - 1
    r = Reporter(RANK)
    for name in cases_for(SIZE):
        r.case(name, CASES.function(name))
    r.write()
    hvd.shutdown()


if __name__ == "__main__":
    main()
