"""Early reductions (hvdlite/common/engine/early.py) under real MPI: a named small allreduce
repeated alone is reduced beside the negotiation round, and the result is exactly what the
usual path gives, or the early result is dropped and the tensor runs as usual.

* ``early.<dtype>``: every op (and prescale/postscale where the dtype allows), in place and
  out of place, a 0-d and a 3-D shape, each name repeated: results exact, the same bits as
  with early reductions off, and early reductions counted;
* ``early.loop``: a loop of synchronous allreduces over several named tensors (a model's
  parameters, a list of metrics), pass after pass: each predicts the next, exact results;
* ``early.bits``: random float32, float16 and bfloat16 values (inexact sums): the same bits on
  every rank and as with early reductions off;
* ``early.misses``: ranks arriving at random moments, two names taking turns, a name changing
  shape in the middle, two tensors in flight at once, an unnamed tensor between: always the
  right result (and the shape change still an error only where it is one);
* ``early.join``: a rank joins while the others repeat a planned tensor: the others' results
  count it as the identity, as without early reductions;
* ``early.off_and_large``: with early reductions off, or a tensor over the limit, none happen;
* ``early.process_set``: a process set of ranks 0 and 1 plans its own (3 ranks and more).
"""
import random
import time

import numpy as np

import hvdlite as hvd
from hvdlite.common.engine.early import EARLY_MAX_BYTES
from hvdlite.common.runtime import registry, state
from tests.workers import core_cases as cc
from tests.workers._report import Reporter
from tests.workers.core_refs import (allreduce_expected, attempt, check_array, check_exact,
                                     digest)

from mpi4py import MPI  # noqa: E402

SUBSET = hvd.ProcessSet([0, 1]) if MPI.COMM_WORLD.Get_size() > 2 else None
hvd.init(process_sets=[SUBSET] if SUBSET is not None else None)
RANK, SIZE = hvd.rank(), hvd.size()
ENGINE = state.engine()
REPEATS = 6   # two rounds to learn the pattern, then early
r = Reporter(RANK)


def set_early(engine, on: bool) -> None:
    """Switch early reductions on or off on every rank (in effect from the round after the
    barrier, in which every rank's switch agrees)."""
    engine.early_on = on
    hvd.barrier()


def total(x: np.ndarray, name: str) -> np.ndarray:
    return hvd.allreduce(x, op=hvd.Sum, name=name)


def repeat(name: str, inputs: list[np.ndarray], in_place: bool, **kw) -> list:
    """``REPEATS`` allreduces of this rank's input under one name (fresh copies each time)."""
    results = []
    for _ in range(REPEATS):
        x = inputs[RANK].copy()
        if in_place:
            got = attempt(lambda: hvd.allreduce_(x, name=name, **kw))
            results.append(x if got is x else got)
        else:
            results.append(attempt(lambda: hvd.allreduce(x, name=name, **kw)))
            check_exact(f"{name}: input untouched", x, inputs[RANK])
    return results


def dtype_case(dtype: str) -> None:
    ops = [op for op in cc.OPS if not (dtype == "bool" and op == "Average")]
    scales = [(1.0, 1.0)] if dtype == "bool" else [(1.0, 1.0), (0.5, 3.0)]
    before = ENGINE.early_reductions
    runs = []   # (label, results with early reductions, expected)
    for op in ops:
        for pre, post in scales:
            for shape in ((), (2, 3, 4)):
                for in_place in (False, True):
                    label = f"early.{dtype}.{op}.{pre}.{len(shape)}d.{in_place}"
                    inputs = [cc.op_input(label, k, dtype, op, shape) for k in range(SIZE)]
                    kw = dict(op=getattr(hvd, op), prescale_factor=pre, postscale_factor=post)
                    got = repeat(label, inputs, in_place, **kw)
                    runs.append((label, got, inputs, in_place, kw,
                                 allreduce_expected(inputs, dtype, op, SIZE, pre, post)))
    early = ENGINE.early_reductions - before
    set_early(ENGINE, False)
    try:
        usual = [repeat(label + ".usual", inputs, in_place, **kw)
                 for label, _, inputs, in_place, kw, _ in runs]
    finally:
        set_early(ENGINE, True)
    for (label, got, _, _, _, want), plain in zip(runs, usual):
        for i, g in enumerate(got):
            check_array(f"{label}[{i}]", g, want)
            assert digest(g) == digest(plain[i]), f"{label}[{i}]: bits differ from the usual path"
    # every name repeated REPEATS times alone: all but its first three are early
    assert early == len(runs) * (REPEATS - 3), f"{early} early reductions for {len(runs)} names"


def loop_case() -> None:
    specs = [("float32", (5,)), ("int64", (3, 2)), ("float64", ()), ("float16", (40,)),
             ("int32", (1000,))]
    inputs = [[cc.op_input(f"early.loop.{i}", k, dt, "Sum", shape) for k in range(SIZE)]
              for i, (dt, shape) in enumerate(specs)]
    wants = [allreduce_expected(xs, dt, "Sum", SIZE) for xs, (dt, _) in zip(inputs, specs)]
    passes = 6
    before = ENGINE.early_reductions
    for p in range(passes):
        for i, (xs, want) in enumerate(zip(inputs, wants)):
            check_array(f"pass {p} tensor {i}", total(xs[RANK], f"early.loop.{i}"), want)
    early = ENGINE.early_reductions - before
    # pass 1 negotiates, pass 2 learns each successor, pass 3 predicts all but the first
    n = len(specs)
    assert early == (n - 1) + n * (passes - 3), f"{early} early reductions"


def bits_case() -> None:
    for dtype in ("float32", "float16", "bfloat16"):
        rng = np.random.default_rng([7, RANK])
        x = rng.standard_normal(257).astype(cc.np_dtype(dtype))
        got = repeat(f"early.bits.{dtype}", [x] * SIZE, False, op=hvd.Sum)
        set_early(ENGINE, False)
        try:
            plain = repeat(f"early.bits.{dtype}.usual", [x] * SIZE, False, op=hvd.Sum)
        finally:
            set_early(ENGINE, True)
        mine = [digest(g) for g in got]
        assert mine[3:] == [digest(p) for p in plain][3:], f"{dtype}: early bits differ"
        every = hvd.allgather_object(mine)
        assert all(d == mine for d in every), f"{dtype}: ranks received different bits"


def misses_case() -> None:
    rng = random.Random(RANK)
    inputs = {n: [cc.op_input(f"early.miss.{n}", k, "int32", "Sum", (9,)) for k in range(SIZE)]
              for n in ("a", "b")}
    want = {n: allreduce_expected(xs, "int32", "Sum", SIZE) for n, xs in inputs.items()}
    for step in range(40):
        name = "a" if (step // 5) % 2 == 0 else "b"   # five of one, then five of the other
        time.sleep(rng.random() * 0.003)   # ranks arrive at different moments
        got = hvd.allreduce(inputs[name][RANK], op=hvd.Sum, name=f"early.miss.{name}")
        check_array(f"step {step} ({name})", got, want[name])
        if step == 20:   # an unnamed tensor between two planned ones
            check_exact("unnamed", hvd.allreduce(np.ones(3, np.int64), op=hvd.Sum),
                        np.full(3, SIZE, np.int64))
    for _ in range(4):   # two tensors in flight at once: one round, nothing alone
        ha = hvd.allreduce_async(inputs["a"][RANK], op=hvd.Sum, name="early.miss.a")
        hb = hvd.allreduce_async(inputs["b"][RANK], op=hvd.Sum, name="early.miss.b")
        check_array("pair a", ha.wait(), want["a"])
        check_array("pair b", hb.wait(), want["b"])
    for _ in range(4):
        check_array("a again", total(inputs["a"][RANK], "early.miss.a"), want["a"])
    # the same name with another shape on every rank: a new negotiation, the right result
    wide = [cc.op_input("early.miss.wide", k, "int32", "Sum", (11,)) for k in range(SIZE)]
    check_array("new shape", hvd.allreduce(wide[RANK], op=hvd.Sum, name="early.miss.a"),
                allreduce_expected(wide, "int32", "Sum", SIZE))
    for _ in range(4):
        check_array("a planned", hvd.allreduce(inputs["a"][RANK], op=hvd.Sum, name="early.miss.a"),
                    want["a"])
    # then a shape change on one rank only: the mismatch error, on every rank
    odd = np.zeros(5 if RANK == SIZE - 1 else 9, np.int32)
    err = attempt(lambda: hvd.allreduce(odd, op=hvd.Sum, name="early.miss.a"))
    assert isinstance(err, hvd.HorovodInternalError) and "early.miss.a" in str(err), repr(err)
    check_array("after the error", total(inputs["b"][RANK], "early.miss.b"), want["b"])


def join_case() -> None:
    last = SIZE - 1
    inputs = [cc.op_input("early.join", k, "float32", "Sum", (6,)) for k in range(SIZE)]
    for _ in range(REPEATS):
        check_array("before", hvd.allreduce(inputs[RANK], op=hvd.Sum, name="early.join"),
                    allreduce_expected(inputs, "float32", "Sum", SIZE))
    if RANK == last:
        joined = hvd.join()
    else:
        for _ in range(3):
            got = hvd.allreduce(inputs[RANK], op=hvd.Sum, name="early.join")
            check_array("joined", got, allreduce_expected(inputs[:last], "float32", "Sum", SIZE))
        joined = hvd.join()
    assert joined != last, f"join() returned {joined}, the rank that joined first"
    assert len(set(hvd.allgather_object(joined))) == 1, "ranks disagree on the last to join"
    for _ in range(REPEATS):   # everyone back: early again
        check_array("after", hvd.allreduce(inputs[RANK], op=hvd.Sum, name="early.join"),
                    allreduce_expected(inputs, "float32", "Sum", SIZE))


def off_and_large_case() -> None:
    x = np.ones(3, np.float32)
    set_early(ENGINE, False)
    try:
        before = ENGINE.early_reductions
        for _ in range(REPEATS):
            check_exact("off", total(x, "early.off"), np.full(3, SIZE, np.float32))
        assert ENGINE.early_reductions == before, "early reductions while off"
    finally:
        set_early(ENGINE, True)
    big = np.ones(EARLY_MAX_BYTES // 4 + 1, np.float32)
    before = ENGINE.early_reductions
    for _ in range(REPEATS):
        check_exact("large", hvd.allreduce(big, op=hvd.Sum, name="early.large"),
                    np.full(big.size, SIZE, np.float32))
    assert ENGINE.early_reductions == before, "a tensor over the limit was reduced early"


def process_set_case() -> None:
    if SUBSET is None or RANK not in (0, 1):
        return
    engine = registry.process_set_engine(SUBSET, "test")[0]
    before = engine.early_reductions
    x = np.full(4, RANK + 1, np.int64)
    for _ in range(REPEATS):
        check_exact("subset", hvd.allreduce(x, op=hvd.Sum, name="early.subset",
                                                  process_set=SUBSET),
                    np.full(4, 3, np.int64))
    assert engine.early_reductions - before == REPEATS - 3, engine.early_reductions - before


for dt in cc.DTYPES:
    r.case(f"early.{dt}", dtype_case, dt)
r.case("early.loop", loop_case)
r.case("early.bits", bits_case)
r.case("early.misses", misses_case)
r.case("early.join", join_case)
r.case("early.off_and_large", off_and_large_case)
r.case("early.process_set", process_set_case)
r.write()
hvd.shutdown()
