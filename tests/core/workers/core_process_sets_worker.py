"""Process sets under real MPI launches: the framework-neutral numpy API on subsets of the ranks.

Run as ``core_process_sets_worker.py MODE`` on 2, 3 or 4 ranks; ``cases(MODE, size)`` lists what
one launch reports (it is importable without MPI, so pytest parametrizes from it).  Modes:

* ``static``: sets registered with ``hvd.init(process_sets=[...])``; every collective on every set
  (members check numpy references, non-members check they get ValueError), overlapping sets in
  interleaved order, unnamed ops, mismatch errors, independence of disjoint sets (4 ranks) and
  re-initialization after ``shutdown()``.
* ``dynamic``: ``HVDLITE_DYNAMIC_PROCESS_SETS=1``; add/remove cycles, errors, ``comm.Split`` sets,
  ``comm_process_set`` and pending operations in a removed set.
* ``dynamic_alias``: the same switch spelled ``HOROVOD_DYNAMIC_PROCESS_SETS=1``.
* ``dynamic_init``: ``hvd.init(process_sets="dynamic")`` and what re-init without it means.

Hang safety: every collective is wrapped in ``attempt`` and checks run only after all of a case's
collectives were issued, so a failed check never leaves other ranks waiting; plain mpi4py
collectives (timestamps, cross-rank consistency) are only reached after attempt-wrapped code.  The
pytest side sets HVDLITE_STALL_SHUTDOWN_TIME_SECONDS, so an operation that some member never
submits (e.g. because unnamed ops got different names) fails with StallError instead of hanging.
The report is rewritten after every case, so a job killed on timeout still shows which case hung.
"""
from __future__ import annotations

import itertools
import sys
import time
import zlib

import numpy as np

MODES = ("static", "dynamic", "dynamic_alias", "dynamic_init")
OP_KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped",
            "barrier", "join")


# --- case lists (no MPI needed) ------------------------------------------------------------------
def static_sets(n: int) -> dict[str, list[int]]:
    """The sets registered at init in the static job, in registration order (ids 1, 2, ...)."""
    if n == 2:
        return {"s0": [0], "s1": [1]}
    if n == 3:
        return {"even": [0, 2], "low": [0, 1], "single": [1]}
    if n == 4:
        return {"even": [0, 2], "odd": [1, 3], "overlap": [0, 1, 2], "single": [3],
                "A": [0, 1], "B": [2, 3]}
    raise ValueError(f"no process-set layout for {n} ranks")


def dynamic_sets(n: int) -> list[list[int]]:
    return {2: [[0], [1]], 3: [[0, 2], [0, 1], [1]],
            4: [[0, 2], [1, 3], [0, 1, 2], [3]]}[n]


def mismatch_set(n: int) -> str | None:
    """A static multi-rank set whose global ranks differ from its set-local ranks."""
    return {3: "even", 4: "odd"}.get(n)


def cases(mode: str, n: int) -> list[str]:
    if mode == "static":
        out = ["static.ids_and_ranks", "static.set_attributes", "static.global_set_explicit",
               "static.add_remove_need_dynamic", "static.comm_process_set", "static.local_errors",
               "static.process_set_wrong_type"]
        out += [f"{op}.{s}" for s in ["global", *static_sets(n)] for op in OP_KINDS]
        out += ["static.overlapping_interleaved", "static.unnamed_ops_keep_global_names"]
        if mismatch_set(n):
            out.append("static.mismatch_names_global_ranks")
        if n == 4:
            out.append("static.independent_disjoint_sets")
        out += ["reinit.shutdown_clears_ids", "reinit.same_objects", "reinit.different_sets"]
        return out
    if mode == "dynamic":
        out = ["dyn.initially_only_global", "dyn.add_remove_cycles", "dyn.add_returns",
               "dyn.errors", "dyn.split_halves", "dyn.split_parity", "dyn.comm_process_set"]
        if n >= 3:
            out.append("dyn.remove_fails_pending")
        out.append("dyn.reinit")
        return out
    if mode == "dynamic_alias":
        return ["alias.cycle"]
    if mode == "dynamic_init":
        return ["dyninit.cycle", "dyninit.bad_arguments", "dyninit.reinit_without_dynamic"]
    raise ValueError(f"unknown mode {mode!r}")


# --- the worker ----------------------------------------------------------------------------------
if __name__ == "__main__":
    from mpi4py import MPI

    import hvdlite as hvd
    from tests.workers.core_refs import allreduce_expected, attempt, check_array, check_exact
    from tests.workers.nodes import host_of_rank, intranode, on_one_node
    from tests.workers._report import Reporter

    MODE = sys.argv[1]
    world = MPI.COMM_WORLD
    RANK, SIZE = world.Get_rank(), world.Get_size()
    SETS: dict = {}          # static mode: name -> registered ProcessSet
    HOSTS = host_of_rank(world)   # a set's window is used only where its ranks share a host


def now() -> float:
    return time.monotonic()   # system-wide on Linux: comparable across the ranks of one host


def vals(case: str, rank: int, shape, dtype) -> np.ndarray:
    """Deterministic small integers (exact in every dtype used), regenerated on any rank."""
    rng = np.random.default_rng([zlib.crc32(case.encode()), rank])
    return np.asarray(rng.integers(-8, 9, size=shape)).astype(dtype)


def split_counts(rows: int, parts: int) -> list[int]:
    """Horovod's rule, written independently: the first rows % parts ranks get one extra row."""
    return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]


def wait(h):
    """Wait on a handle (or pass an exception through)."""
    if isinstance(h, BaseException):
        return h
    return attempt(h.wait)


def ok(label: str, got):
    if isinstance(got, BaseException):
        raise AssertionError(f"{label}: raised {type(got).__name__}: {got}")
    return got


def expect_value_error(label: str, outcome, *fragments: str) -> str:
    if not isinstance(outcome, ValueError):
        raise AssertionError(f"{label}: expected ValueError, got {outcome!r}")
    msg = str(outcome)
    for frag in fragments:
        assert frag in msg, f"{label}: message lacks {frag!r}: {msg}"
    return msg


def check_nonmember(label: str, ranks: list[int], set_id, outcome) -> None:
    """A non-member calling an op on a set gets ValueError naming this rank and the set."""
    msg = expect_value_error(f"{label} (rank {RANK} is not in {ranks})", outcome, f"rank {RANK}")
    assert str(ranks) in msg or f"process set {set_id}" in msg, (
        f"{label}: message does not name the set (id {set_id}, ranks {ranks}): {msg}")


def expect_nonmember(label: str, ps, fn) -> None:
    check_nonmember(label, ps.ranks, ps.process_set_id, attempt(fn))


def nonmember_calls(kind: str, ps, name: str) -> dict:
    k = len(ps.ranks)
    x = np.ones(4)
    root = ps.ranks[0]
    calls = {
        "allreduce": {
            "allreduce": lambda: hvd.allreduce(x, op=hvd.Sum, name=name, process_set=ps),
            "allreduce_": lambda: hvd.allreduce_(x.copy(), name=name, process_set=ps),
            "allreduce_async": lambda: hvd.allreduce_async(x, name=name, process_set=ps),
            "allreduce_async_": lambda: hvd.allreduce_async_(x.copy(), name=name,
                                                             process_set=ps),
            "unnamed": lambda: hvd.allreduce(x, process_set=ps)},
        "allgather": {
            "allgather": lambda: hvd.allgather(x, name=name, process_set=ps),
            "allgather_async": lambda: hvd.allgather_async(x, name=name, process_set=ps),
            "unnamed": lambda: hvd.allgather(x, process_set=ps)},
        "broadcast": {
            "broadcast": lambda: hvd.broadcast(x, root, name=name, process_set=ps),
            "broadcast_": lambda: hvd.broadcast_(x.copy(), root, name=name, process_set=ps),
            "broadcast_async": lambda: hvd.broadcast_async(x, root, name=name, process_set=ps),
            "broadcast_async_": lambda: hvd.broadcast_async_(x.copy(), root, name=name,
                                                             process_set=ps),
            "unnamed": lambda: hvd.broadcast(x, root, process_set=ps)},
        "alltoall": {
            "alltoall": lambda: hvd.alltoall(np.ones(2 * k), name=name, process_set=ps),
            "alltoall_async": lambda: hvd.alltoall_async(np.ones(2 * k), name=name,
                                                         process_set=ps)},
        "reducescatter": {
            "reducescatter": lambda: hvd.reducescatter(np.ones((k, 2)), name=name,
                                                       process_set=ps),
            "reducescatter_async": lambda: hvd.reducescatter_async(np.ones((k, 2)), name=name,
                                                                   process_set=ps)},
        "grouped": {
            "grouped_allreduce": lambda: hvd.grouped_allreduce([x, x], name=name,
                                                               process_set=ps),
            "grouped_allreduce_": lambda: hvd.grouped_allreduce_([x.copy()], name=name,
                                                                 process_set=ps),
            "grouped_allreduce_async": lambda: hvd.grouped_allreduce_async([x], process_set=ps),
            "grouped_allgather": lambda: hvd.grouped_allgather([x], name=name, process_set=ps),
            "grouped_allgather_async": lambda: hvd.grouped_allgather_async([x], process_set=ps),
            "grouped_reducescatter": lambda: hvd.grouped_reducescatter(
                [np.ones((k, 2))], name=name, process_set=ps),
            "grouped_reducescatter_async": lambda: hvd.grouped_reducescatter_async(
                [np.ones((k, 2))], process_set=ps)},
        "barrier": {"barrier": lambda: hvd.barrier(process_set=ps)},
        "join": {"join": lambda: hvd.join(process_set=ps)},
    }
    return calls[kind]


# --- per-set collective cases (members: numpy references; others: ValueError) -----------------
def case_allreduce(case: str, ps) -> None:
    M = ps.ranks
    k = len(M)
    xs = {g: vals(case, g, (5,), np.float64) for g in M}
    ints = {g: vals(case + ".i", g, (2, 3), np.int32) for g in M}
    halves = {g: vals(case + ".h", g, (4,), np.float16) for g in M}
    x, xi = xs[RANK], ints[RANK]
    kw = dict(process_set=ps)
    out = {}
    out["sum"] = attempt(lambda: hvd.allreduce(x, op=hvd.Sum, name=case + ".sum", **kw))
    out["average"] = attempt(lambda: hvd.allreduce(x, name=case + ".avg", **kw))
    out["average=True"] = attempt(lambda: hvd.allreduce(x, average=True, name=case + ".avgf",
                                                        **kw))
    out["int average"] = attempt(lambda: hvd.allreduce(xi, op=hvd.Average, name=case + ".iavg",
                                                       **kw))
    out["int min"] = attempt(lambda: hvd.allreduce(xi, op=hvd.Min, name=case + ".imin", **kw))
    out["max"] = attempt(lambda: hvd.allreduce(x, op=hvd.Max, name=case + ".max", **kw))
    out["product"] = attempt(lambda: hvd.allreduce(x, op=hvd.Product, name=case + ".prod",
                                                   **kw))
    out["float16 sum"] = attempt(lambda: hvd.allreduce(halves[RANK], op=hvd.Sum,
                                                       name=case + ".f16", **kw))
    out["scaled"] = attempt(lambda: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5,
                                                  postscale_factor=3.0, name=case + ".sc", **kw))
    y = x.copy()
    inplace = attempt(lambda: hvd.allreduce_(y, op=hvd.Sum, name=case + ".inplace", **kw))
    h1 = attempt(lambda: hvd.allreduce_async(x, name=case + ".async", **kw))
    z = xi.copy()
    h2 = attempt(lambda: hvd.allreduce_async_(z, op=hvd.Sum, name=case + ".async_", **kw))
    out["async average"] = wait(h1)
    async_inplace = wait(h2)
    out["unnamed sum"] = attempt(lambda: hvd.allreduce(x, op=hvd.Sum, **kw))

    f = [xs[g] for g in M]
    i = [ints[g] for g in M]
    check_array("sum", out["sum"], allreduce_expected(f, "float64", "Sum", k))
    check_array("unnamed sum", out["unnamed sum"], allreduce_expected(f, "float64", "Sum", k))
    for label in ("average", "average=True", "async average"):   # divides by the SET size
        check_array(label, out[label], allreduce_expected(f, "float64", "Average", k))
    check_array("int average", out["int average"], allreduce_expected(i, "int32", "Average", k))
    check_array("int min", out["int min"], allreduce_expected(i, "int32", "Min", k))
    check_array("max", out["max"], allreduce_expected(f, "float64", "Max", k))
    check_array("product", out["product"], allreduce_expected(f, "float64", "Product", k))
    check_array("float16 sum", out["float16 sum"],
                allreduce_expected([halves[g] for g in M], "float16", "Sum", k))
    check_array("scaled", out["scaled"],
                allreduce_expected(f, "float64", "Sum", k, pre=0.5, post=3.0))
    assert inplace is y, f"allreduce_ returned {inplace!r}, not its array"
    check_array("in place", y, allreduce_expected(f, "float64", "Sum", k))
    check_array("async in place (array)", z, allreduce_expected(i, "int32", "Sum", k))
    check_array("async in place (result)", async_inplace, allreduce_expected(i, "int32", "Sum", k))
    assert np.array_equal(x, xs[RANK]), "out-of-place allreduce changed its input"


def case_allgather(case: str, ps) -> None:
    M = ps.ranks
    xs = {g: vals(case, g, (g % 3, 2), np.int16) for g in M}   # some members give no rows
    fs = {g: vals(case + ".f", g, (M.index(g) + 1, 2, 2), np.float32) for g in M}
    kw = dict(process_set=ps)
    sync = attempt(lambda: hvd.allgather(xs[RANK], name=case, **kw))
    asyn = wait(attempt(lambda: hvd.allgather_async(fs[RANK], name=case + ".a", **kw)))
    scalar = attempt(lambda: hvd.allgather(np.array(RANK * 10 + 1, dtype=np.int64),
                                           name=case + ".scalar", **kw))
    unnamed = attempt(lambda: hvd.allgather(xs[RANK], **kw))
    want = np.concatenate([xs[g] for g in M])      # in the set's (ascending global) rank order
    check_exact("allgather", sync, want)
    check_exact("unnamed allgather", unnamed, want)
    check_exact("allgather_async", asyn, np.concatenate([fs[g] for g in M]))
    check_exact("0-d allgather", scalar, np.array([g * 10 + 1 for g in M], dtype=np.int64))


def case_broadcast(case: str, ps) -> None:
    M = ps.ranks
    xs = {g: vals(case, g, (2, 3), np.float32) for g in M}
    x = xs[RANK]
    kw = dict(process_set=ps)
    by_root = {root: attempt(lambda: hvd.broadcast(x, root, name=f"{case}.r{root}", **kw))
               for root in M}
    y = x.copy()
    inplace = attempt(lambda: hvd.broadcast_(y, M[-1], name=case + ".inplace", **kw))
    h1 = attempt(lambda: hvd.broadcast_async(x, M[0], name=case + ".async", **kw))
    z = x.copy()
    h2 = attempt(lambda: hvd.broadcast_async_(z, M[-1], name=case + ".async_", **kw))
    got_async, got_async_inplace = wait(h1), wait(h2)
    unnamed = attempt(lambda: hvd.broadcast(x, M[-1], **kw))
    # root_rank is a global rank and must be a member (a valid set-local index is not enough)
    bad_roots = [g for g in range(SIZE) if g not in M] + [SIZE, -1]
    bad = {root: attempt(lambda: hvd.broadcast(x, root, name=f"{case}.bad{root}", **kw))
           for root in bad_roots}
    bad_inplace = {root: attempt(lambda: hvd.broadcast_(x.copy(), root,
                                                        name=f"{case}.bad_{root}", **kw))
                   for root in bad_roots}

    for root, got in by_root.items():
        check_exact(f"broadcast from global rank {root}", got, xs[root])
    assert inplace is y, f"broadcast_ returned {inplace!r}, not its array"
    check_exact("broadcast_", y, xs[M[-1]])
    check_exact("broadcast_async", got_async, xs[M[0]])
    assert got_async_inplace is z, f"broadcast_async_ yielded {got_async_inplace!r}"
    check_exact("broadcast_async_", z, xs[M[-1]])
    check_exact("unnamed broadcast", unnamed, xs[M[-1]])
    assert np.array_equal(x, xs[RANK]), "out-of-place broadcast changed its input"
    for root in bad_roots:
        expect_value_error(f"broadcast with root_rank={root} outside {M}", bad[root],
                           f"root_rank={root}")
        expect_value_error(f"broadcast_ with root_rank={root} outside {M}", bad_inplace[root])


def case_alltoall(case: str, ps) -> None:
    M = ps.ranks
    k, me = len(M), M.index(RANK)

    def even_input(g):   # two rows for each member; row (dest d, j) holds g*100 + d*10 + j
        return np.array([[g * 100 + d * 10 + j, -(g * 100 + d * 10 + j)]
                         for d in range(k) for j in range(2)], dtype=np.int32)

    def splits_of(g):
        i = M.index(g)
        return [(i + j + 1) % 3 for j in range(k)]   # includes zero-row splits when k > 1

    var = {g: vals(case + ".v", g, (sum(splits_of(g)), 3), np.float32) for g in M}
    kw = dict(process_set=ps)
    even = attempt(lambda: hvd.alltoall(even_input(RANK), name=case + ".even", **kw))
    explicit = attempt(lambda: hvd.alltoall(var[RANK], splits=splits_of(RANK),
                                            name=case + ".splits", **kw))
    asyn = wait(attempt(lambda: hvd.alltoall_async(var[RANK],
                                                   splits=np.array(splits_of(RANK)),
                                                   name=case + ".async", **kw)))
    unnamed = attempt(lambda: hvd.alltoall(even_input(RANK), **kw))
    wrong = None
    if k != SIZE:   # splits sized for the whole job, not for the set
        wrong = attempt(lambda: hvd.alltoall(np.ones(SIZE), splits=[1] * SIZE,
                                             name=case + ".wrong", **kw))

    want_even = np.concatenate([even_input(g)[2 * me:2 * me + 2] for g in M])
    for label, got in (("even split", even), ("unnamed", unnamed)):
        got = ok(label, got)
        assert isinstance(got, tuple) and len(got) == 2, f"{label}: returned {got!r}"
        check_exact(label, got[0], want_even)
        assert np.asarray(got[1]).tolist() == [2] * k, f"{label}: received splits {got[1]}"
    pieces, rsplits = [], []
    for g in M:
        off = sum(splits_of(g)[:me])
        n = splits_of(g)[me]
        pieces.append(var[g][off:off + n])
        rsplits.append(n)
    for label, got in (("explicit splits", explicit), ("alltoall_async", asyn)):
        got = ok(label, got)
        check_exact(label, got[0], np.concatenate(pieces))
        assert np.asarray(got[1]).tolist() == rsplits, f"{label}: received splits {got[1]}"
    if wrong is not None:
        expect_value_error("alltoall with one split per job rank", wrong)


def case_reducescatter(case: str, ps) -> None:
    M = ps.ranks
    k, me = len(M), M.index(RANK)
    rows = 2 * k + 1
    xs = {g: vals(case, g, (rows, 3), np.float64) for g in M}
    ints = {g: vals(case + ".i", g, (rows,), np.int32) for g in M}
    kw = dict(process_set=ps)
    s = attempt(lambda: hvd.reducescatter(xs[RANK], op=hvd.Sum, name=case + ".sum", **kw))
    a = attempt(lambda: hvd.reducescatter(xs[RANK], name=case + ".avg", **kw))
    m = attempt(lambda: hvd.reducescatter(ints[RANK], op=hvd.Max, name=case + ".imax", **kw))
    sc = attempt(lambda: hvd.reducescatter(xs[RANK], op=hvd.Sum, prescale_factor=2.0,
                                           postscale_factor=0.25, name=case + ".sc", **kw))
    h = wait(attempt(lambda: hvd.reducescatter_async(ints[RANK], op=hvd.Sum,
                                                     name=case + ".async", **kw)))
    unnamed = attempt(lambda: hvd.reducescatter(xs[RANK], op=hvd.Sum, **kw))

    counts = split_counts(rows, k)
    lo = sum(counts[:me])
    mine = slice(lo, lo + counts[me])
    f = [xs[g][mine] for g in M]
    i = [ints[g][mine] for g in M]
    check_array("Sum", s, allreduce_expected(f, "float64", "Sum", k))
    check_array("unnamed Sum", unnamed, allreduce_expected(f, "float64", "Sum", k))
    check_array("Average (default)", a, allreduce_expected(f, "float64", "Average", k))
    check_array("int Max", m, allreduce_expected(i, "int32", "Max", k))
    check_array("scaled Sum", sc, allreduce_expected(f, "float64", "Sum", k, pre=2.0, post=0.25))
    check_array("async int Sum", h, allreduce_expected(i, "int32", "Sum", k))


def case_grouped(case: str, ps) -> None:
    M = ps.ranks
    k, me = len(M), M.index(RANK)
    a = {g: vals(case + ".a", g, (4,), np.float32) for g in M}
    b = {g: vals(case + ".b", g, (2, 2), np.int64) for g in M}
    c = {g: vals(case + ".c", g, (M.index(g) % 2 + 1, 2), np.int8) for g in M}
    e = {g: vals(case + ".e", g, (2 * k + 1, 2), np.float64) for g in M}
    kw = dict(process_set=ps)
    ar = attempt(lambda: hvd.grouped_allreduce([a[RANK], b[RANK]], op=hvd.Sum,
                                               name=case + ".ar", **kw))
    ys = [a[RANK].copy(), b[RANK].copy()]
    ar_ = attempt(lambda: hvd.grouped_allreduce_(ys, op=hvd.Max, name=case + ".ar_", **kw))
    ar_avg = wait(attempt(lambda: hvd.grouped_allreduce_async([a[RANK]], name=case + ".avg",
                                                              **kw)))
    ag = attempt(lambda: hvd.grouped_allgather([c[RANK], np.float64(RANK + 0.5)],
                                               name=case + ".ag", **kw))
    rs = attempt(lambda: hvd.grouped_reducescatter([e[RANK], b[RANK].reshape(-1)], op=hvd.Sum,
                                                   name=case + ".rs", **kw))
    unnamed = attempt(lambda: hvd.grouped_allreduce([b[RANK], a[RANK]], op=hvd.Sum, **kw))
    # 360 KB fuse into one batch: reduced through the set's own shared-memory window when its
    # ranks share a host (tests/multihost runs this worker across hosts too)
    big = {g: [vals(f"{case}.big{i}", g, (30000,), np.float32) for i in range(3)] for g in M}
    got_big = attempt(lambda: hvd.grouped_allreduce(big[RANK], op=hvd.Sum, name=case + ".big",
                                                    **kw))

    A, B = [a[g] for g in M], [b[g] for g in M]
    got_big = ok("large grouped_allreduce", got_big)
    for i in range(3):
        check_array(f"large grouped_allreduce[{i}]", got_big[i],
                    allreduce_expected([big[g][i] for g in M], "float32", "Sum", k))
    if k > 1:
        from hvdlite.common.runtime.registry import process_set_engine
        shared = intranode(process_set_engine(ps, "test")[0]).shared
        if on_one_node(HOSTS, M):
            assert shared is not None and shared.batches > 0, \
                "the large group did not go through the set's shared-memory window"
        else:
            assert shared is None or shared.batches == 0, \
                "the large group of a set spanning hosts went through a shared-memory window"
    ar = ok("grouped_allreduce", ar)
    assert isinstance(ar, list) and len(ar) == 2, f"grouped_allreduce returned {ar!r}"
    check_array("grouped_allreduce[0]", ar[0], allreduce_expected(A, "float32", "Sum", k))
    check_array("grouped_allreduce[1]", ar[1], allreduce_expected(B, "int64", "Sum", k))
    ok("grouped_allreduce_", ar_)
    check_array("grouped_allreduce_[0]", ys[0], allreduce_expected(A, "float32", "Max", k))
    check_array("grouped_allreduce_[1]", ys[1], allreduce_expected(B, "int64", "Max", k))
    check_array("grouped_allreduce_async Average", ok("avg", ar_avg)[0],
                allreduce_expected(A, "float32", "Average", k))
    ag = ok("grouped_allgather", ag)
    check_exact("grouped_allgather[0]", ag[0], np.concatenate([c[g] for g in M]))
    check_exact("grouped_allgather[1]", ag[1], np.array([g + 0.5 for g in M]))
    rs = ok("grouped_reducescatter", rs)
    counts0, counts1 = split_counts(2 * k + 1, k), split_counts(4, k)
    lo0, lo1 = sum(counts0[:me]), sum(counts1[:me])
    check_array("grouped_reducescatter[0]", rs[0], allreduce_expected(
        [e[g][lo0:lo0 + counts0[me]] for g in M], "float64", "Sum", k))
    check_array("grouped_reducescatter[1]", rs[1], allreduce_expected(
        [b[g].reshape(-1)[lo1:lo1 + counts1[me]] for g in M], "int64", "Sum", k))
    unnamed = ok("unnamed grouped_allreduce", unnamed)
    check_array("unnamed grouped[0]", unnamed[0], allreduce_expected(B, "int64", "Sum", k))
    check_array("unnamed grouped[1]", unnamed[1], allreduce_expected(A, "float32", "Sum", k))


def case_barrier(case: str, ps) -> None:
    M = ps.ranks
    time.sleep(0.05 * M.index(RANK))
    entered = now()
    first = attempt(lambda: hvd.barrier(process_set=ps))
    left = now()
    second = attempt(lambda: hvd.barrier(process_set=ps))   # the same internal name again
    times = attempt(lambda: hvd.allgather(np.array([[entered, left]]), name=case + ".times",
                                          process_set=ps))
    assert first is None and second is None, f"barrier returned {first!r}, {second!r}"
    times = ok("gathering barrier times", times)
    assert times.shape == (len(M), 2), times.shape
    assert times[:, 1].min() >= times[:, 0].max(), (
        f"a member left the barrier before another entered it: {times.tolist()}")


def case_join(case: str, ps) -> None:
    M = ps.ranks
    k = len(M)
    xs = {g: vals(case, g, (3,), np.float64) for g in M}
    summed = averaged = None
    if k > 1 and RANK == M[0]:     # joins at once; the others reduce without it, then join
        last = attempt(lambda: hvd.join(process_set=ps))
    else:
        if k > 1:
            summed = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name=case + ".sum",
                                                   process_set=ps))
            averaged = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Average,
                                                     name=case + ".avg", process_set=ps))
        last = attempt(lambda: hvd.join(process_set=ps))
    last_i = int(last) if isinstance(last, (int, np.integer)) else -1
    lasts = attempt(lambda: hvd.allgather(np.array([last_i]), name=case + ".lasts",
                                          process_set=ps))
    after = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name=case + ".after",
                                          process_set=ps))

    ok("join", last)
    others = M[1:] if k > 1 else M
    assert last_i in others, f"join returned {last!r}; the last to join was one of {others}"
    lasts = ok("gathering join results", lasts)
    assert len(set(lasts.tolist())) == 1, f"members disagree on the last rank: {lasts.tolist()}"
    if summed is not None:   # the joined member contributes zeros; Average still divides by k
        contrib = [xs[g] if g != M[0] else np.zeros(3) for g in M]
        check_array("Sum while a member joined", summed,
                    allreduce_expected(contrib, "float64", "Sum", k))
        check_array("Average while a member joined", averaged,
                    allreduce_expected(contrib, "float64", "Average", k))
    check_array("allreduce after join", after,
                allreduce_expected([xs[g] for g in M], "float64", "Sum", k))


OP_CASES = {"allreduce": case_allreduce, "allgather": case_allgather,
            "broadcast": case_broadcast, "alltoall": case_alltoall,
            "reducescatter": case_reducescatter, "grouped": case_grouped,
            "barrier": case_barrier, "join": case_join}


def op_case(kind: str, set_name: str) -> None:
    ps = hvd.global_process_set if set_name == "global" else SETS[set_name]
    case = f"{kind}.{set_name}"
    if RANK in ps.ranks:
        OP_CASES[kind](case, ps)
        return
    for label, fn in nonmember_calls(kind, ps, case).items():
        expect_nonmember(label, ps, fn)


# --- static job: general cases -------------------------------------------------------------------
def static_ids_and_ranks() -> None:
    layout = static_sets(SIZE)
    ids = [SETS[n].process_set_id for n in layout]
    assert ids == list(range(1, len(layout) + 1)), f"static ids {ids}"
    for n, ranks in layout.items():
        assert SETS[n].ranks == ranks, f"set {n}: ranks {SETS[n].ranks} != {ranks}"
    table = hvd.get_process_set_ids_and_ranks()
    want = {0: list(range(SIZE)), **{i + 1: r for i, r in enumerate(layout.values())}}
    assert table == want, f"get_process_set_ids_and_ranks() = {table}, want {want}"
    g = hvd.global_process_set
    assert g.process_set_id == 0 and g.ranks == list(range(SIZE)), repr(g)


def static_set_attributes() -> None:
    g = hvd.global_process_set
    assert (g.size(), g.rank(), g.included()) == (SIZE, RANK, True), (g.size(), g.rank())
    for n, ps in SETS.items():
        assert ps.size() == len(ps.ranks), f"{n}: size() {ps.size()}"
        assert ps.included() == (RANK in ps.ranks), f"{n}: included() {ps.included()}"
        if RANK in ps.ranks:
            assert ps.rank() == ps.ranks.index(RANK), f"{n}: rank() {ps.rank()}"
        else:
            expect_value_error(f"{n}.rank() on a non-member", attempt(ps.rank), str(RANK))
    dup = attempt(lambda: hvd.ProcessSet([0, 0]))
    expect_value_error("ProcessSet([0, 0])", dup)
    fresh = hvd.ProcessSet([1, 0])
    assert fresh.ranks == [0, 1] and fresh.process_set_id is None, repr(fresh)
    expect_value_error("size() of an unregistered set", attempt(fresh.size))


def static_global_set_explicit() -> None:
    x = vals("gse", RANK, (4,), np.float64)
    a = attempt(lambda: hvd.allreduce(x, op=hvd.Sum, name="gse",
                                      process_set=hvd.global_process_set))
    b = attempt(lambda: hvd.allreduce(x, name="gse.avg", process_set=hvd.global_process_set))
    inputs = [vals("gse", g, (4,), np.float64) for g in range(SIZE)]
    check_array("Sum on global_process_set", a, allreduce_expected(inputs, "float64", "Sum",
                                                                   SIZE))
    check_array("Average on global_process_set", b,
                allreduce_expected(inputs, "float64", "Average", SIZE))


def static_add_remove_need_dynamic() -> None:
    before = hvd.get_process_set_ids_and_ranks()
    add = attempt(lambda: hvd.add_process_set([0]))
    add_obj = attempt(lambda: hvd.add_process_set(hvd.ProcessSet([SIZE - 1])))
    rm = attempt(lambda: hvd.remove_process_set(SETS[next(iter(SETS))]))
    expect_value_error("add_process_set without dynamic sets", add, "DYNAMIC_PROCESS_SETS")
    expect_value_error("add_process_set(ProcessSet) without dynamic sets", add_obj)
    expect_value_error("remove_process_set without dynamic sets", rm)
    assert hvd.get_process_set_ids_and_ranks() == before, "a refused call changed the sets"
    assert SETS[next(iter(SETS))].process_set_id == 1


def static_comm_process_set() -> None:
    found = attempt(lambda: hvd.comm_process_set(world))
    per_set = {}
    for n, ps in SETS.items():
        comm = world.Split(color=0 if RANK in ps.ranks else MPI.UNDEFINED, key=RANK)
        if comm != MPI.COMM_NULL:
            per_set[n] = attempt(lambda: hvd.comm_process_set(comm))
            comm.Free()
    registered = [tuple(r) for r in hvd.get_process_set_ids_and_ranks().values()]
    spare = next((list(c) for n in range(1, SIZE) for c in itertools.combinations(range(SIZE), n)
                  if c not in registered), None)
    missing = None
    if spare is not None:
        comm = world.Split(color=0 if RANK in spare else MPI.UNDEFINED, key=RANK)
        if comm != MPI.COMM_NULL:
            missing = attempt(lambda: hvd.comm_process_set(comm))
            comm.Free()

    ok("comm_process_set(COMM_WORLD)", found)
    assert found.process_set_id == 0 and found.ranks == list(range(SIZE)), repr(found)
    for n, got in per_set.items():
        got = ok(f"comm_process_set(<comm of {n}>)", got)
        assert got.process_set_id == SETS[n].process_set_id and got.ranks == SETS[n].ranks, (
            f"comm_process_set for {n} returned {got!r}, want {SETS[n]!r}")
    if spare is not None and RANK in spare:
        expect_value_error(f"comm_process_set(<comm of unregistered {spare}>)", missing)


def static_local_errors() -> None:
    x = np.ones(3)
    never = hvd.ProcessSet([0])
    unreg = attempt(lambda: hvd.allreduce(x, name="le.unreg", process_set=never))
    unreg_g = attempt(lambda: hvd.grouped_allreduce([x], name="le.unregg", process_set=never))
    expect_value_error("allreduce on a never-registered ProcessSet", unreg, "not registered")
    expect_value_error("grouped_allreduce on a never-registered ProcessSet", unreg_g)


def static_process_set_wrong_type() -> None:
    got = attempt(lambda: hvd.allreduce(np.ones(3), name="wt", process_set=[0, 1]))
    got2 = attempt(lambda: hvd.allgather(np.ones(3), name="wt2", process_set="global"))
    for label, g in (("process_set=[0, 1]", got), ("process_set='global'", got2)):
        if not isinstance(g, TypeError):
            raise AssertionError(f"{label}: expected TypeError naming ProcessSet, got {g!r}")
        assert "ProcessSet" in str(g), f"{label}: {g}"


def op_input(set_name: str, i: int, g: int) -> np.ndarray:
    return vals(f"ov.{set_name}.{i}", g, (3,), np.int64)


def static_overlapping_interleaved() -> None:
    sets = [("global", hvd.global_process_set)] + list(SETS.items())
    mine = [(n, ps) for n, ps in sets if RANK in ps.ranks]
    plan = [(n, ps, i) for i in range(4) for n, ps in mine]   # round robin over my sets
    if RANK % 2:
        plan = plan[::-1]                                    # other ranks: opposite order

    def submit(n, ps, i):
        x = op_input(n, i, RANK)
        if i % 3 == 0:
            return hvd.allreduce_async(x, op=hvd.Sum, name=f"ov.{n}.{i}", process_set=ps)
        if i % 3 == 1:
            return hvd.allgather_async(x, name=f"ov.{n}.{i}", process_set=ps)
        return hvd.broadcast_async(x, ps.ranks[i % len(ps.ranks)], name=f"ov.{n}.{i}",
                                   process_set=ps)

    handles = {(n, i): attempt(lambda: submit(n, ps, i)) for n, ps, i in plan}
    order = sorted(handles, key=lambda key: zlib.crc32(repr((key, RANK)).encode()))
    got = {key: wait(handles[key]) for key in order}
    blocking = {}
    for rnd in range(2):   # blocking calls: one order on every rank (no cross-set cycle)
        for n, ps in mine:
            x = op_input(n, 10 + rnd, RANK)
            blocking[(n, rnd)] = attempt(lambda: hvd.allreduce(x, op=hvd.Max,
                                                               name=f"ovb.{n}.{rnd}",
                                                               process_set=ps))
    for n, ps, i in plan:
        M = ps.ranks
        inputs = [op_input(n, i, g) for g in M]
        label = f"set {n} op {i}"
        if i % 3 == 0:
            check_array(label, got[(n, i)], allreduce_expected(inputs, "int64", "Sum", len(M)))
        elif i % 3 == 1:
            check_exact(label, got[(n, i)], np.concatenate(inputs))
        else:
            check_exact(label, got[(n, i)], inputs[i % len(M)])
    for (n, rnd), g in blocking.items():
        M = dict(sets)[n].ranks
        check_array(f"blocking {n} {rnd}", g, allreduce_expected(
            [op_input(n, 10 + rnd, r) for r in M], "int64", "Max", len(M)))


def static_unnamed_ops() -> None:
    """Unnamed ops in sets (members only) interleaved with unnamed global ops: the global
    names must stay aligned on every rank (else they stall and fail)."""
    records = []
    for step in range(3):
        records.append(("global", "allreduce", step, attempt(lambda: hvd.allreduce_async(
            np.array([RANK + step], dtype=np.int64), op=hvd.Sum))))
        for n, ps in SETS.items():
            if RANK not in ps.ranks:
                continue
            records.append((n, "allreduce", step, attempt(lambda: hvd.allreduce_async(
                np.full(2, RANK * (step + 1), dtype=np.int64), op=hvd.Sum, process_set=ps))))
            records.append((n, "allgather", step, attempt(lambda: hvd.allgather_async(
                np.array([RANK, step], dtype=np.int32), process_set=ps))))
            records.append((n, "grouped", step, attempt(lambda: hvd.grouped_allreduce_async(
                [np.full(3, float(RANK)), np.array([step], dtype=np.int8)], op=hvd.Max,
                process_set=ps))))
        records.append(("global", "allgather", step, attempt(lambda: hvd.allgather_async(
            np.array([RANK * 10 + step], dtype=np.int16)))))
        records.append(("global", "broadcast", step, attempt(lambda: hvd.broadcast_async(
            np.array([RANK, step], dtype=np.float32), SIZE - 1))))
        records.append(("global", "blocking", step, attempt(lambda: hvd.allreduce(
            np.array([1.0]), op=hvd.Sum))))
    results = [(n, kind, step, r if kind == "blocking" else wait(r))
               for n, kind, step, r in records]
    for n, kind, step, got in results:
        M = list(range(SIZE)) if n == "global" else SETS[n].ranks
        label = f"unnamed {kind} step {step} on {n}"
        if kind == "allreduce" and n == "global":
            check_exact(label, got, np.array([sum(M) + step * SIZE], dtype=np.int64))
        elif kind == "allreduce":
            check_exact(label, got, np.full(2, sum(M) * (step + 1), dtype=np.int64))
        elif kind == "allgather" and n == "global":
            check_exact(label, got, np.array([g * 10 + step for g in M], dtype=np.int16))
        elif kind == "allgather":
            check_exact(label, got, np.array([[g, step] for g in M], dtype=np.int32).reshape(-1))
        elif kind == "grouped":
            got = ok(label, got)
            check_exact(label + "[0]", got[0], np.full(3, float(max(M))))
            check_exact(label + "[1]", got[1], np.array([step], dtype=np.int8))
        elif kind == "broadcast":
            check_exact(label, got, np.array([SIZE - 1, step], dtype=np.float32))
        else:
            check_exact(label, got, np.array([float(SIZE)]))


def static_mismatch() -> None:
    ps = SETS[mismatch_set(SIZE)]
    M = ps.ranks
    results = {}
    if RANK in M:
        shape = (4,) if RANK == M[-1] else (3,)
        results["shape"] = attempt(lambda: hvd.allreduce(np.ones(shape), name="mm.shape",
                                                         process_set=ps))
        root = M[0] if RANK == M[-1] else M[-1]
        results["root"] = attempt(lambda: hvd.broadcast(np.ones(2), root, name="mm.root",
                                                        process_set=ps))
        results["after"] = attempt(lambda: hvd.allreduce(np.full(2, float(RANK)), op=hvd.Sum,
                                                         name="mm.shape", process_set=ps))
    # the global set keeps working meanwhile (and afterwards)
    results["global"] = attempt(lambda: hvd.allreduce(np.array([RANK]), op=hvd.Sum,
                                                      name="mm.global"))
    check_exact("global allreduce", results["global"], np.array([sum(range(SIZE))]))
    if RANK not in M:
        return
    others, odd = M[:-1], M[-1]
    err = results["shape"]
    if not isinstance(err, hvd.TensorMismatchError):
        raise AssertionError(f"expected TensorMismatchError in set {M}, got {err!r}")
    msg = str(err)
    for frag in ("mm.shape", f"(3,) on ranks {others}", f"(4,) on ranks [{odd}]",
                 f"Ranks [{odd}] disagree with rank {M[0]}"):
        assert frag in msg, f"message lacks {frag!r} (global ranks): {msg}"
    err = results["root"]
    if not isinstance(err, hvd.TensorMismatchError):
        raise AssertionError(f"expected TensorMismatchError for the root, got {err!r}")
    msg = str(err)
    for frag in (f"root rank {M[-1]} on ranks {others}", f"root rank {M[0]} on ranks [{odd}]"):
        assert frag in msg, f"message lacks {frag!r} (global ranks): {msg}"
    check_exact("allreduce after the mismatch", results["after"],
                np.full(2, float(sum(M))))


def static_independence() -> None:
    """A = [0, 1] runs 50 allreduces while B = [2, 3] is blocked (rank 2 sleeps before its
    first op in B, rank 3 waits in B): A must finish before B's first op completes."""
    A, B = SETS["A"], SETS["B"]
    mine = A if RANK in A.ranks else B
    x = np.arange(4.0) + RANK
    world.Barrier()
    t0 = now()    # reference: both sets run 50 ops at once, nobody sleeps
    ref_out = attempt(lambda: [hvd.allreduce(x, op=hvd.Sum, name="ind.ref", process_set=mine)
                               for _ in range(50)])
    ref = now() - t0
    sleep_s = min(8.0, max(2.0, 10 * max(world.allgather(ref))))
    world.Barrier()
    start, wake = now(), None
    if mine is A:
        out = attempt(lambda: [hvd.allreduce(x * i, op=hvd.Sum, name="ind.a", process_set=A)
                               for i in range(50)])
    else:
        if RANK == B.ranks[0]:
            time.sleep(sleep_s)
        wake = now()
        out = attempt(lambda: hvd.allreduce(x, op=hvd.Sum, name="ind.b", process_set=B))
    end = now()
    everyone = world.allgather({"rank": RANK, "start": start, "end": end, "wake": wake})

    M = mine.ranks
    want_ref = sum(np.arange(4.0) + g for g in M)
    for j, got in enumerate(ok("reference run", ref_out)):
        check_exact(f"reference op {j}", got, want_ref)
    if mine is A:
        for i, got in enumerate(ok("ops in A", out)):
            check_exact(f"A op {i}", got, want_ref * i)
    else:
        check_exact("op in B", out, want_ref)
    a_end = max(e["end"] for e in everyone if e["rank"] in A.ranks)
    a_took = max(e["end"] - e["start"] for e in everyone if e["rank"] in A.ranks)
    b_end = min(e["end"] for e in everyone if e["rank"] in B.ranks)
    b_wake = max(e["wake"] for e in everyone if e["rank"] in B.ranks)
    detail = (f"A's 50 ops took {a_took:.3f} s (reference {ref:.3f} s), ended at {a_end:.3f}; "
              f"B's sleeper woke at {b_wake:.3f} after {sleep_s:.2f} s; B's first op ended at "
              f"{b_end:.3f}")
    assert b_end >= b_wake, f"B completed before its member arrived (test set-up): {detail}"
    assert a_end < b_end, f"A's ops waited for the blocked set B: {detail}"
    assert a_took < sleep_s / 2, f"A's ops took about as long as B's sleep: {detail}"


# --- re-initialization (static job, last) -------------------------------------------------------
OLD: list = []


def reinit_shutdown_clears_ids() -> None:
    OLD[:] = list(SETS.values())
    world.Barrier()                      # nobody has anything in flight
    hvd.shutdown()
    assert not hvd.is_initialized()
    ids = [ps.process_set_id for ps in OLD]
    assert ids == [None] * len(OLD), f"after shutdown the sets still have ids {ids}"
    assert hvd.global_process_set.process_set_id == 0
    expect_value_error("get_process_set_ids_and_ranks() after shutdown",
                       attempt(hvd.get_process_set_ids_and_ranks))


def reinit_same_objects() -> None:
    hvd.init(process_sets=OLD)           # the same (now unregistered) objects, same order
    layout = static_sets(SIZE)
    ids = [ps.process_set_id for ps in OLD]
    outs = {}
    for ps in OLD:
        if RANK in ps.ranks:
            outs[ps.process_set_id] = (
                attempt(lambda: hvd.allreduce(np.array([RANK]), op=hvd.Sum, name="ri.same",
                                              process_set=ps)),
                attempt(lambda: hvd.allreduce(np.array([RANK + 1]), op=hvd.Sum,
                                              process_set=ps)))
    table = hvd.get_process_set_ids_and_ranks()
    assert ids == list(range(1, len(OLD) + 1)), f"ids after re-init {ids}"
    want = {0: list(range(SIZE)), **{i + 1: r for i, r in enumerate(layout.values())}}
    assert table == want, f"table after re-init {table}"
    for ps in OLD:
        if RANK in ps.ranks:
            named, unnamed = outs[ps.process_set_id]
            check_exact(f"named op in {ps.ranks}", named, np.array([sum(ps.ranks)]))
            check_exact(f"unnamed op in {ps.ranks}", unnamed,
                        np.array([sum(ps.ranks) + len(ps.ranks)]))


def reinit_different_sets() -> None:
    """Re-init with other sets, one a comm.Split; id 1 now has other members than before."""
    world.Barrier()
    hvd.shutdown()
    halves = world.Split(color=int(RANK >= SIZE // 2), key=RANK)
    half = [g for g in range(SIZE) if (g >= SIZE // 2) == (RANK >= SIZE // 2)]
    first = {2: None, 3: [0, 1], 4: [0, 3]}[SIZE]
    objs = ([hvd.ProcessSet(first)] if first else []) + [hvd.ProcessSet(halves)]
    hvd.init(process_sets=objs)
    table = hvd.get_process_set_ids_and_ranks()
    records = []
    for ps in objs:
        if RANK in ps.ranks:
            for i in range(3):   # unnamed, in a set whose id was used by other members before
                records.append((ps, i, attempt(lambda: hvd.allreduce_async(
                    np.array([RANK, i]), op=hvd.Sum, process_set=ps))))
            records.append((ps, "named", attempt(lambda: hvd.allreduce_async(
                np.array([RANK, -1]), op=hvd.Sum, name="rd.named", process_set=ps))))
    results = [(ps, i, wait(h)) for ps, i, h in records]
    stale = attempt(lambda: hvd.allreduce(np.ones(2), name="rd.stale", process_set=OLD[0]))
    via_comm = attempt(lambda: hvd.comm_process_set(halves))
    glob = attempt(lambda: hvd.allreduce(np.array([RANK]), op=hvd.Sum))
    halves.Free()

    want = {0: list(range(SIZE))}
    if first:
        want[1] = first
    base = len(want)
    want[base], want[base + 1] = list(range(SIZE // 2)), list(range(SIZE // 2, SIZE))
    assert table == want, f"table {table}, want {want}"
    assert objs[-1].ranks == half, f"the Split set has ranks {objs[-1].ranks}, want {half}"
    assert objs[-1].process_set_id == (2 if first else 1) + (RANK >= SIZE // 2), (
        f"Split set id {objs[-1].process_set_id}")
    for ps, i, got in results:
        t = -1 if i == "named" else i
        check_exact(f"op {i} (unnamed unless 'named') in {ps.ranks}", got,
                    np.array([sum(ps.ranks), t * len(ps.ranks)]))
    expect_value_error("op on a set of the previous session", stale)
    via_comm = ok("comm_process_set(halves)", via_comm)
    assert via_comm.ranks == half and via_comm.process_set_id == objs[-1].process_set_id, (
        repr(via_comm))
    check_exact("global unnamed op after re-init", glob, np.array([sum(range(SIZE))]))


# --- dynamic jobs --------------------------------------------------------------------------------
def placeholder(ps):
    """What to pass to a collective remove when the add failed: keeps the ranks in step."""
    return ps if isinstance(ps, hvd.ProcessSet) else hvd.ProcessSet([0])


def set_ops(tag: str, ps) -> dict:
    """A few ops in ``ps`` (members) or the non-member error (others); see check_set_ops."""
    if not isinstance(ps, hvd.ProcessSet):
        return {"add": ps}
    if RANK not in ps.ranks:
        return {"nonmember": attempt(lambda: hvd.allreduce(np.ones(2), name=tag + ".x",
                                                           process_set=ps))}
    M = ps.ranks
    x = vals(tag, RANK, (3,), np.float64)
    return {
        "sum": attempt(lambda: hvd.allreduce(x, op=hvd.Sum, name=tag + ".sum", process_set=ps)),
        "unnamed": attempt(lambda: hvd.allreduce(x, process_set=ps)),
        "gather": attempt(lambda: hvd.allgather(np.array([RANK]), name=tag + ".ag",
                                                process_set=ps)),
        "bcast": attempt(lambda: hvd.broadcast(x, M[-1], name=tag + ".bc", process_set=ps)),
    }


def check_set_ops(tag: str, ranks: list[int], out: dict) -> None:
    if "add" in out:
        raise AssertionError(f"{tag}: add_process_set({ranks}) raised {out['add']!r}")
    if RANK not in ranks:
        check_nonmember(f"{tag}: op on {ranks}", ranks, None, out["nonmember"])
        return
    xs = [vals(tag, g, (3,), np.float64) for g in ranks]
    k = len(ranks)
    check_array(f"{tag}: Sum", out["sum"], allreduce_expected(xs, "float64", "Sum", k))
    check_array(f"{tag}: unnamed Average", out["unnamed"],
                allreduce_expected(xs, "float64", "Average", k))
    check_exact(f"{tag}: allgather", out["gather"], np.array(ranks))
    check_exact(f"{tag}: broadcast", out["bcast"], xs[-1])


def dyn_initially_only_global() -> None:
    table = hvd.get_process_set_ids_and_ranks()
    assert table == {0: list(range(SIZE))}, table


def add_remove_cycles(tag: str, n_cycles: int) -> None:
    specs = dynamic_sets(SIZE)
    records = []
    for cycle in range(n_cycles):
        order = specs if cycle % 2 == 0 else specs[::-1]
        added = []
        for j, ranks in enumerate(order):
            arg = hvd.ProcessSet(ranks) if (cycle + j) % 2 else list(ranks)
            added.append((ranks, arg, attempt(lambda: hvd.add_process_set(arg))))
        ids = [getattr(ps, "process_set_id", None) for _, _, ps in added]
        all_ids = world.allgather(ids)
        table = attempt(hvd.get_process_set_ids_and_ranks)
        glob = attempt(lambda: hvd.allreduce(np.array([RANK, cycle]), op=hvd.Sum,
                                             name=f"{tag}.g{cycle}"))
        ops = [set_ops(f"{tag}.c{cycle}.{j}", ps) for j, (_, _, ps) in enumerate(added)]
        # remove the first half, keep using the rest, then remove the rest
        cut = len(added) // 2
        removed_first = [attempt(lambda: hvd.remove_process_set(placeholder(ps)))
                         for _, _, ps in added[:cut]]
        on_removed = [attempt(lambda: hvd.allreduce(np.ones(2), name=f"{tag}.rm{cycle}",
                                                    process_set=ps))
                      for _, _, ps in added[:cut] if isinstance(ps, hvd.ProcessSet)]
        ops_after = [set_ops(f"{tag}.c{cycle}.after{j}", ps)
                     for j, (_, _, ps) in enumerate(added[cut:])]
        removed_rest = [attempt(lambda: hvd.remove_process_set(placeholder(ps)))
                        for _, _, ps in added[cut:]]
        table_after = attempt(hvd.get_process_set_ids_and_ranks)
        records.append((cycle, added, ids, all_ids, table, glob, ops, removed_first, on_removed,
                        ops_after, removed_rest, table_after))

    for (cycle, added, ids, all_ids, table, glob, ops, removed_first, on_removed, ops_after,
         removed_rest, table_after) in records:
        c = f"cycle {cycle}"
        for ranks, arg, ps in added:
            ps = ok(f"{c}: add_process_set({ranks})", ps)
            assert isinstance(ps, hvd.ProcessSet), f"{c}: add returned {ps!r}"
            if isinstance(arg, hvd.ProcessSet):
                assert ps is arg, f"{c}: add_process_set(ProcessSet) returned another object"
            assert ps.ranks == ranks, f"{c}: registered ranks {ps.ranks} != {ranks}"
        assert all(row == ids for row in all_ids), f"{c}: ids differ across ranks: {all_ids}"
        assert 0 not in ids and len(set(ids)) == len(ids), f"{c}: ids {ids}"
        want = {0: list(range(SIZE)), **{i: r for i, (r, _, _) in zip(ids, added)}}
        assert ok(f"{c}: table", table) == want, f"{c}: table {table}, want {want}"
        check_exact(f"{c}: global op between", glob,
                    np.array([sum(range(SIZE)), cycle * SIZE]))
        for j, ((ranks, _, _), out) in enumerate(zip(added, ops)):
            check_set_ops(f"{tag}.c{cycle}.{j}", ranks, out)
        for j, ((ranks, _, _), out) in enumerate(zip(added[len(removed_first):], ops_after)):
            check_set_ops(f"{tag}.c{cycle}.after{j}", ranks, out)
        assert removed_first + removed_rest == [True] * len(added), (
            f"{c}: remove_process_set returned {removed_first + removed_rest}")
        for (ranks, _, ps) in added:
            assert ps.process_set_id is None, f"{c}: removed set still has id {ps!r}"
        for err in on_removed:
            expect_value_error(f"{c}: op on a removed set", err)
        assert ok(f"{c}: table after", table_after) == {0: list(range(SIZE))}, table_after


def dyn_add_returns() -> None:
    from_list = attempt(lambda: hvd.add_process_set([SIZE - 1]))
    obj = hvd.ProcessSet([0])
    from_obj = attempt(lambda: hvd.add_process_set(obj))
    rm = [attempt(lambda: hvd.remove_process_set(placeholder(p))) for p in (from_list, from_obj)]
    from_list = ok("add_process_set(list)", from_list)
    assert isinstance(from_list, hvd.ProcessSet) and from_list.ranks == [SIZE - 1], from_list
    assert ok("add_process_set(ProcessSet)", from_obj) is obj, from_obj
    assert rm == [True, True], f"remove_process_set returned {rm}"


def dyn_errors() -> None:
    keep = attempt(lambda: hvd.add_process_set([0]))
    keep_id = getattr(keep, "process_set_id", None)
    before = attempt(hvd.get_process_set_ids_and_ranks)
    errs = {
        "same ranks again (list)": attempt(lambda: hvd.add_process_set([0])),
        "same ranks again (new object)": attempt(lambda: hvd.add_process_set(hvd.ProcessSet([0]))),
        "the registered object again": attempt(lambda: hvd.add_process_set(placeholder(keep))),
        "the global set's ranks": attempt(lambda: hvd.add_process_set(list(range(SIZE)))),
        "different ranks on different processes": attempt(
            lambda: hvd.add_process_set([RANK])),
        "out of range": attempt(lambda: hvd.add_process_set([SIZE])),
        "empty": attempt(lambda: hvd.add_process_set([])),
        "remove the global set": attempt(lambda: hvd.remove_process_set(hvd.global_process_set)),
    }
    after = attempt(hvd.get_process_set_ids_and_ranks)
    still = set_ops("dyn.errors.still", placeholder(keep))
    rm = attempt(lambda: hvd.remove_process_set(placeholder(keep)))
    rm_again = attempt(lambda: hvd.remove_process_set(placeholder(keep)))
    on_removed = attempt(lambda: hvd.allreduce(np.ones(1), name="dyn.errors.removed",
                                               process_set=placeholder(keep)))
    final = attempt(hvd.get_process_set_ids_and_ranks)

    keep = ok("add_process_set([0])", keep)
    for label, err in errs.items():
        expect_value_error(label, err)
    assert "different" in str(errs["different ranks on different processes"]), (
        errs["different ranks on different processes"])
    assert ok("table before", before) == ok("table after", after) == {
        0: list(range(SIZE)), keep_id: [0]}, f"refused calls changed the sets: {before} -> {after}"
    check_set_ops("dyn.errors.still", [0], still)
    assert rm is True, f"remove_process_set returned {rm!r}"
    assert rm_again is False, f"removing an already removed set returned {rm_again!r}"
    expect_value_error("op on the removed set", on_removed)
    assert final == {0: list(range(SIZE))}, final


def dyn_split(kind: str) -> None:
    def color(g):
        return int(g >= SIZE // 2) if kind == "halves" else g % 2

    comm = world.Split(color=color(RANK), key=RANK)
    mine = [g for g in range(SIZE) if color(g) == color(RANK)]
    obj = hvd.ProcessSet(comm)
    ret = attempt(lambda: hvd.add_process_set(obj))
    info = world.allgather((getattr(ret, "process_set_id", None), obj._ranks))
    table = attempt(hvd.get_process_set_ids_and_ranks)
    via_comm = attempt(lambda: hvd.comm_process_set(comm))
    via_id, obj_id = getattr(via_comm, "process_set_id", None), obj.process_set_id
    attrs = attempt(lambda: (obj.size(), obj.rank(), obj.included()))
    x = vals("split." + kind, RANK, (4,), np.int64)
    summed = attempt(lambda: hvd.allreduce(x, op=hvd.Sum, name="split.sum", process_set=obj))
    unnamed = attempt(lambda: hvd.allreduce(x, op=hvd.Sum, process_set=obj))
    bcast = attempt(lambda: hvd.broadcast(x, mine[-1], name="split.bc", process_set=obj))
    gathered = attempt(lambda: hvd.allgather(np.array([RANK]), name="split.ag", process_set=obj))
    rm = attempt(lambda: hvd.remove_process_set(placeholder(ret)))
    table_after = attempt(hvd.get_process_set_ids_and_ranks)
    comm.Free()

    assert ok("add_process_set(ProcessSet(comm))", ret) is obj, f"returned {ret!r}"
    assert obj.ranks == mine, f"ranks {obj._ranks}, want {mine}"
    ids = {}
    for g, (set_id, ranks) in enumerate(info):
        ids.setdefault(color(g), set()).add(set_id)
        assert ranks == [h for h in range(SIZE) if color(h) == color(g)], info
    assert all(len(v) == 1 for v in ids.values()), f"one part got several ids: {info}"
    distinct = [next(iter(v)) for v in ids.values()]
    assert len(set(distinct)) == len(distinct) and 0 not in distinct, f"ids {info}"
    want = {0: list(range(SIZE)), **{i: r for i, r in info}}
    assert ok("table", table) == want, f"table {table}, want {want}"
    via_comm = ok("comm_process_set", via_comm)
    assert via_comm is obj and via_id == obj_id, f"comm_process_set gave {via_comm!r} " \
        f"(id {via_id}), want this rank's set (id {obj_id})"
    assert ok("size/rank/included", attrs) == (len(mine), mine.index(RANK), True), attrs
    inputs = [vals("split." + kind, g, (4,), np.int64) for g in mine]
    check_exact("Sum in my part", summed, sum(inputs))
    check_exact("unnamed Sum in my part", unnamed, sum(inputs))
    check_exact("broadcast from my part's last rank", bcast, inputs[-1])
    check_exact("allgather in my part", gathered, np.array(mine))
    assert rm is True, f"remove_process_set returned {rm!r}"
    assert obj.process_set_id is None, repr(obj)
    assert table_after == {0: list(range(SIZE))}, f"after removing both parts: {table_after}"


def dyn_comm_process_set() -> None:
    world_set = attempt(lambda: hvd.comm_process_set(world))
    added = attempt(lambda: hvd.add_process_set([0, SIZE - 1] if SIZE > 2 else [0]))
    members = added.ranks if isinstance(added, hvd.ProcessSet) else [0]
    comm = world.Split(color=0 if RANK in members else MPI.UNDEFINED, key=RANK)
    found = attempt(lambda: hvd.comm_process_set(comm)) if comm != MPI.COMM_NULL else None
    rm = attempt(lambda: hvd.remove_process_set(placeholder(added)))
    gone = attempt(lambda: hvd.comm_process_set(comm)) if comm != MPI.COMM_NULL else None
    if comm != MPI.COMM_NULL:
        comm.Free()

    world_set = ok("comm_process_set(COMM_WORLD)", world_set)
    assert world_set.process_set_id == 0 and world_set.ranks == list(range(SIZE)), world_set
    added = ok("add_process_set", added)
    if found is not None:
        found = ok("comm_process_set(<comm of the set>)", found)
        assert found.ranks == members, found
        assert found is added, f"comm_process_set gave {found!r}, not the registered set"
        expect_value_error("comm_process_set after removal", gone)
    assert rm is True, rm


def dyn_remove_fails_pending() -> None:
    ps = attempt(lambda: hvd.add_process_set([0, 1]))
    h = None
    if RANK == 0 and isinstance(ps, hvd.ProcessSet):   # rank 1 never submits it
        h = attempt(lambda: hvd.allreduce_async(np.ones(3), name="orphan", process_set=ps))
        time.sleep(0.3)
    world.Barrier()
    rm = attempt(lambda: hvd.remove_process_set(placeholder(ps)))
    got = attempt(lambda: h.wait(timeout=30)) if h is not None and not isinstance(
        h, BaseException) else h
    later = attempt(lambda: hvd.allreduce(np.array([RANK]), op=hvd.Sum, name="after.orphan"))

    ok("add_process_set([0, 1])", ps)
    assert rm is True, f"remove_process_set returned {rm!r}"
    if RANK == 0:
        if not isinstance(got, hvd.HvdliteError):
            raise AssertionError(f"the op pending in the removed set should fail with an "
                                 f"HvdliteError, got {got!r}")
    check_exact("global op afterwards", later, np.array([sum(range(SIZE))]))


def dyn_reinit(expect_dynamic: bool = True) -> None:
    """Shutdown and init() again: dynamic sets still enabled by the environment; the new
    session's ids may reuse old ones with other members (unnamed ops must still line up)."""
    world.Barrier()
    hvd.shutdown()
    hvd.init()
    first = [0, 1] if SIZE > 2 else [1]
    ps = attempt(lambda: hvd.add_process_set(first))
    records = []
    if isinstance(ps, hvd.ProcessSet) and RANK in ps.ranks:
        for i in range(3):
            records.append(attempt(lambda: hvd.allreduce_async(np.array([RANK, i]), op=hvd.Sum,
                                                               process_set=ps)))
    results = [wait(h) for h in records]
    table = attempt(hvd.get_process_set_ids_and_ranks)
    ps_id = getattr(ps, "process_set_id", None)
    rm = attempt(lambda: hvd.remove_process_set(placeholder(ps)))
    ok("add_process_set after re-init", ps)
    for i, got in enumerate(results):
        check_exact(f"unnamed op #{i} after re-init", got,
                    np.array([sum(first), i * len(first)]))
    assert ok("table", table) == {0: list(range(SIZE)), ps_id: first}, table
    assert rm is True, rm


def dyninit_bad_arguments() -> None:
    world.Barrier()
    hvd.shutdown()
    bogus = attempt(lambda: hvd.init(process_sets="static"))
    not_sets = attempt(lambda: hvd.init(process_sets=[[0]]))
    initialized = hvd.is_initialized()
    hvd.init(process_sets="dynamic")
    again = attempt(lambda: hvd.add_process_set([0]))
    rm = attempt(lambda: hvd.remove_process_set(placeholder(again)))
    expect_value_error("init(process_sets='static')", bogus)
    if not isinstance(not_sets, TypeError):
        raise AssertionError(f"init(process_sets=[[0]]) should raise TypeError, got "
                             f"{not_sets!r}")
    assert not initialized, "a refused init() left hvdlite initialized"
    ok("add_process_set after init('dynamic')", again)
    assert rm is True, rm


def dyninit_reinit_without_dynamic() -> None:
    world.Barrier()
    hvd.shutdown()
    hvd.init()                                   # no "dynamic" this time, no env switch
    add = attempt(lambda: hvd.add_process_set([0]))
    rm = attempt(lambda: hvd.remove_process_set(hvd.ProcessSet([0])))
    table = hvd.get_process_set_ids_and_ranks()
    expect_value_error("add_process_set after init() without dynamic", add)
    expect_value_error("remove_process_set after init() without dynamic", rm)
    assert table == {0: list(range(SIZE))}, table


# --- main ----------------------------------------------------------------------------------------
if __name__ == "__main__":
    if MODE == "static":
        layout = static_sets(SIZE)
        objs = [hvd.ProcessSet(r) for r in layout.values()]
        hvd.init(process_sets=objs)
        SETS.update(zip(layout, objs))
    elif MODE == "dynamic_init":
        hvd.init(process_sets="dynamic")
    else:
        hvd.init()
    assert (hvd.rank(), hvd.size()) == (RANK, SIZE)
    r = Reporter(RANK)
    named = {
        "static.ids_and_ranks": static_ids_and_ranks,
        "static.set_attributes": static_set_attributes,
        "static.global_set_explicit": static_global_set_explicit,
        "static.add_remove_need_dynamic": static_add_remove_need_dynamic,
        "static.comm_process_set": static_comm_process_set,
        "static.local_errors": static_local_errors,
        "static.process_set_wrong_type": static_process_set_wrong_type,
        "static.overlapping_interleaved": static_overlapping_interleaved,
        "static.unnamed_ops_keep_global_names": static_unnamed_ops,
        "static.mismatch_names_global_ranks": static_mismatch,
        "static.independent_disjoint_sets": static_independence,
        "reinit.shutdown_clears_ids": reinit_shutdown_clears_ids,
        "reinit.same_objects": reinit_same_objects,
        "reinit.different_sets": reinit_different_sets,
        "dyn.initially_only_global": dyn_initially_only_global,
        "dyn.add_remove_cycles": lambda: add_remove_cycles("dyn", 4),
        "dyn.add_returns": dyn_add_returns,
        "dyn.errors": dyn_errors,
        "dyn.split_halves": lambda: dyn_split("halves"),
        "dyn.split_parity": lambda: dyn_split("parity"),
        "dyn.comm_process_set": dyn_comm_process_set,
        "dyn.remove_fails_pending": dyn_remove_fails_pending,
        "dyn.reinit": dyn_reinit,
        "alias.cycle": lambda: add_remove_cycles("alias", 2),
        "dyninit.cycle": lambda: add_remove_cycles("dyninit", 2),
        "dyninit.bad_arguments": dyninit_bad_arguments,
        "dyninit.reinit_without_dynamic": dyninit_reinit_without_dynamic,
    }
    for case in cases(MODE, SIZE):
        kind, _, set_name = case.partition(".")
        if kind in OP_CASES:
            r.case(case, op_case, kind, set_name)
        else:
            r.case(case, named[case])
        r.write()     # after every case: a job killed on timeout still shows how far it got
    world.Barrier()
    hvd.shutdown()
