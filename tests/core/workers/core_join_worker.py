"""hvd.join(): ranks that ran out of data while the others keep reducing, on every rank.

Run under ``mpiexec`` at 2, 3 and 4 ranks (tests/core/test_join.py).  A joined rank takes part in
the other ranks' allreduces with the reduction's identity (zeros for Sum/Average, so Average
still divides by the full number of ranks; +inf/max for Min, -inf/min for Max, 1 for Product);
every other operation fails on the submitting ranks while some rank is joined; join() returns the
global rank of the last rank to join, on every rank.

The last joiner is made deterministic: it runs one more allreduce after the others called join(),
and that allreduce can only complete once every other rank has joined (see ``end_epoch``).
Inputs are regenerated on every rank from the case name, so each rank computes the expected
results locally with numpy (core_refs.allreduce_expected over the ranks still running).  Every
collective and every join() is issued before anything is checked, so a failed check on one rank
never leaves another waiting.

Importable without MPI: ``cases_for(size)`` lists the cases a job of ``size`` ranks reports.
"""
from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # sibling helper modules

import numpy as np  # noqa: E402

import hvdlite as hvd  # noqa: E402
from tests.workers.nodes import intranode  # noqa: E402
from hvdlite.common.runtime import state
from tests.workers._report import CaseRegistry, always, pow2  # noqa: E402
from tests.workers import core_cases as cc  # noqa: E402
from tests.workers.core_refs import (Expected, allreduce_expected, attempt,  # noqa: E402
                                     check_array, check_exact)

RANK = SIZE = LAST = -1      # set by main() after hvd.init()
OP = {name: getattr(hvd, name) for name in cc.OPS}

CASES = CaseRegistry()
register, case = CASES.register, CASES.case


def cases_for(size: int) -> list[str]:
    return CASES.names_for(size)


# --- helpers -----------------------------------------------------------------------------------
def finish(h):
    if isinstance(h, BaseException):
        return h
    return attempt(lambda: hvd.synchronize(h))


def joined_expected(inputs: list[np.ndarray], active: list[int], dtype: str, op: str,
                    pre: float = 1.0, post: float = 1.0) -> Expected:
    """What an allreduce gives when only ``active`` ranks submit and the others have joined:
    the reduction over the active ranks (Average still divides by the full number of ranks)."""
    mine = [inputs[k] for k in active]
    if op == "Average":
        return allreduce_expected(mine, dtype, "Sum", SIZE, pre, post * (1.0 / SIZE))
    return allreduce_expected(mine, dtype, op, SIZE, pre, post)


def check_join(label: str, got, want: int) -> None:
    if isinstance(got, BaseException):
        raise AssertionError(f"{label}: join() raised {type(got).__name__}: {got}")
    assert isinstance(got, int) and got == want, f"{label}: join() returned {got!r}, want {want}"


def end_epoch(tag: str, last: int):
    """Every calling rank but ``last`` joins at once; ``last`` first runs an allreduce that can
    only complete once all others have joined (so it joins last).  Returns a check."""
    xs = [np.arange(3, dtype=np.float64) + 10 * k for k in range(SIZE)]
    extra = None
    if RANK == last:
        extra = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name=tag + ".extra"))
    got = attempt(hvd.join)

    def check():
        check_join(tag, got, last)
        if RANK == last:
            check_array("last joiner's allreduce", extra, Expected("float64", exact=xs[last]))
    return check


def everyone_works(tag: str):
    """Plain allreduce/allgather/broadcast by every rank (after a join epoch); returns a check."""
    xs = [cc.op_input(tag, k, "int32", "Sum", (4,)) for k in range(SIZE)]
    avg_in = [np.full(2, float(k + 1)) for k in range(SIZE)]
    s = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name=tag + ".sum"))
    a = attempt(lambda: hvd.allreduce(avg_in[RANK], name=tag + ".avg"))
    g = attempt(lambda: hvd.allgather(xs[RANK], name=tag + ".ag"))
    b = attempt(lambda: hvd.broadcast(xs[RANK], LAST, name=tag + ".bc"))

    def check():
        check_array("allreduce after join", s, allreduce_expected(xs, "int32", "Sum", SIZE))
        check_array("average after join (all ranks count)", a,
                    allreduce_expected(avg_in, "float64", "Average", SIZE, exact_inputs=False))
        check_exact("allgather after join", g, np.concatenate(xs))
        check_exact("broadcast after join", b, xs[LAST])
    return check


# --- ranks join at different steps ------------------------------------------------------------
JOIN_DTYPES = ["int32", "uint8", "float64", "bfloat16"]


def steps_case(name: str, op: str, dtype: str) -> None:
    """Rank r runs r+1 steps, then joins (so the last rank joins last).  Every step has a named
    allreduce repeated each step (cached after step 0) and a fresh one (negotiated in full)."""
    results = []
    for step in range(RANK + 1):
        active = list(range(step, SIZE))   # ranks that still run step ``step``
        cached_in = [cc.op_input(f"{name}.c{step}", k, dtype, op, (5,)) for k in range(SIZE)]
        fresh_in = [cc.op_input(f"{name}.f{step}", k, dtype, op, (2, 3)) for k in range(SIZE)]
        h = attempt(lambda: hvd.allreduce_async(fresh_in[RANK], op=OP[op],
                                                name=f"{name}.step{step}"))
        cached = attempt(lambda: hvd.allreduce(cached_in[RANK], op=OP[op],
                                               name=f"{name}.cached"))
        results.append((step, cached, joined_expected(cached_in, active, dtype, op),
                        finish(h), joined_expected(fresh_in, active, dtype, op)))
    last = attempt(hvd.join)
    for step, cached, exp_c, fresh, exp_f in results:
        check_array(f"step {step} cached", cached, exp_c)
        check_array(f"step {step} fresh", fresh, exp_f)
    check_join("join", last, LAST)


for _op in cc.OPS:
    for _dt in JOIN_DTYPES:
        _name = f"join.steps.{_op}.{_dt}"
        register(_name, functools.partial(steps_case, _name, _op, _dt))
for _op in ("Sum", "Min", "Max", "Product"):
    _name = f"join.steps.{_op}.bool"
    register(_name, functools.partial(steps_case, _name, _op, "bool"))


def scaled_case(name: str, op: str, dtype: str) -> None:
    """Rank 0 has joined; the others reduce with prescale/postscale factors, one tensor alone
    and two small ones in flight together (fused).  The joined rank must still contribute the
    identity of the reduction, not a scaled identity."""
    factors = [(2.0, 0.5), (0.5, 3.0)]
    if dtype in cc.FLOAT_DTYPES:
        factors.append((-1.0, 1.0))
    active = list(range(1, SIZE))
    inputs = {f"{name}.{i}{part}": [cc.op_input(f"{name}.{i}{part}", k, dtype, op, (4,))
                                    for k in range(SIZE)]
              for i in range(len(factors)) for part in ("", ".a", ".b")}
    if RANK == 0:
        got = attempt(hvd.join)
        check_join("join", got, LAST)
        return
    outs = []
    for i, (pre, post) in enumerate(factors):
        kw = dict(op=OP[op], prescale_factor=pre, postscale_factor=post)
        tag = f"{name}.{i}"
        fused = [(t, attempt(lambda t=t: hvd.allreduce_async(inputs[t][RANK], name=t, **kw)))
                 for t in (tag + ".a", tag + ".b")]
        outs.append((pre, post, tag, attempt(lambda: hvd.allreduce(inputs[tag][RANK],
                                                                   name=tag, **kw))))
        outs += [(pre, post, t, finish(h)) for t, h in fused]
    check = end_epoch(name, LAST)
    for pre, post, tag, out in outs:
        check_array(f"{tag} pre={pre} post={post}", out,
                    joined_expected(inputs[tag], active, dtype, op, pre, post))
    check()


for _op in cc.OPS:
    for _dt in ("int32", "float32"):
        _name = f"join.scaled.{_op}.{_dt}"
        register(_name, functools.partial(scaled_case, _name, _op, _dt))


def large_case(name: str, op: str, count: int, path: str) -> None:
    """Rank 0 has joined; the others reduce single tensors of ``count`` float32, in place and
    out of place, with scale factors, by the intra-node ``path`` ("shared": the shared-memory
    window, from 1 MiB; "direct": copies between the ranks' memory, from 2 MiB): the joined
    rank's identity must stay unscaled there too."""
    active = list(range(1, SIZE))
    tags = [f"{name}.{i}" for i in range(2)]
    inputs = {t: [cc.op_input(t, k, "float32", op, (count,)) for k in range(SIZE)]
              for t in tags}
    if RANK == 0:
        check_join("join", attempt(hvd.join), LAST)
        return
    backend = intranode(state.engine())
    counters = {"direct": backend.direct, "shared": backend.shared}
    before = {k: 0 if c is None else c.singles for k, c in counters.items()}
    kw = dict(op=OP[op], prescale_factor=2.0, postscale_factor=0.5)
    out = attempt(lambda: hvd.allreduce(inputs[tags[0]][RANK], name=tags[0], **kw))
    work = inputs[tags[1]][RANK].copy()
    attempt(lambda: hvd.allreduce_(work, name=tags[1], **kw))
    check = end_epoch(name, LAST)
    for tag, got in zip(tags, (out, work)):
        check_array(tag, got, joined_expected(inputs[tag], active, "float32", op, 2.0, 0.5))
    if path == "direct" and not cc.direct_copies_expected(backend):
        path = "shared"   # (declared unavailable on this machine)
    took = counters[path].singles - before[path]
    assert took == 2, f"{took} of the 2 large tensors took the {path} path"
    check()


for _op in cc.OPS:
    _name = f"join.large.{_op}"
    register(_name, functools.partial(large_case, _name, _op, 300007, "shared"))
    _name = f"join.direct.{_op}"   # (the join tests run with the default HVDLITE_DIRECT_COPIES=auto)
    register(_name, functools.partial(large_case, _name, _op, 600011, "direct"))


@case("join.coordinator_joins_last")
def coordinator_last():
    """Every rank but the coordinator (rank 0) joins at once; rank 0 keeps reducing."""
    results = []
    if RANK == 0:
        for step in range(3):
            avg_in = [cc.op_input(f"jcl.a{step}", k, "float64", "Average", (3,))
                      for k in range(SIZE)]
            max_in = [cc.op_input(f"jcl.m{step}", k, "int32", "Max", (4,)) for k in range(SIZE)]
            a = attempt(lambda: hvd.allreduce(avg_in[0], name="jcl.avg"))
            m = attempt(lambda: hvd.allreduce(max_in[0], op=hvd.Max, name=f"jcl.max{step}"))
            results.append((step, a, joined_expected(avg_in, [0], "float64", "Average"),
                            m, joined_expected(max_in, [0], "int32", "Max")))
    got = attempt(hvd.join)
    for step, a, exp_a, m, exp_m in results:
        check_array(f"step {step} average", a, exp_a)
        check_array(f"step {step} max", m, exp_m)
    check_join("join", got, 0)


@case("join.epochs")
def epochs():
    """Three join epochs in a row, a different last joiner each time, with normal operations by
    every rank in between (names repeated across epochs, so the cache is exercised)."""
    checks = []
    for epoch, last in enumerate([LAST, 0, SIZE // 2]):
        if RANK == last:
            for step in range(2):
                xs = [cc.op_input(f"jep.{epoch}.{step}", k, "int64", "Sum", (3,))
                      for k in range(SIZE)]
                got_c = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name="jep.cached"))
                got_f = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Min,
                                                      name=f"jep.{epoch}.{step}"))
                checks.append(functools.partial(check_array, f"epoch {epoch} step {step}",
                                                got_c, joined_expected(xs, [last], "int64",
                                                                       "Sum")))
                checks.append(functools.partial(check_array, f"epoch {epoch} step {step} min",
                                                got_f, joined_expected(xs, [last], "int64",
                                                                       "Min")))
        got = attempt(hvd.join)
        checks.append(functools.partial(check_join, f"epoch {epoch}", got, last))
        checks.append(everyone_works("jep.after"))
        xs = [np.full(3, k + 1, np.int64) for k in range(SIZE)]
        c = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name="jep.cached"))
        checks.append(functools.partial(check_array, f"epoch {epoch}: cached name, all ranks",
                                        c, allreduce_expected(xs, "int64", "Sum", SIZE)))
    for c in checks:
        c()


@case("join.twice_in_a_row")
def twice_in_a_row():
    first = end_epoch("jtw.1", 0)
    second = end_epoch("jtw.2", LAST)
    first()
    second()


@case("join.everyone_at_once")
def everyone_at_once():
    """No operations at all: every rank gets the same answer, a valid rank."""
    from mpi4py import MPI
    got = attempt(hvd.join)
    everyone = MPI.COMM_WORLD.allgather(got if isinstance(got, int) else repr(got))
    if isinstance(got, BaseException):
        raise AssertionError(f"join() raised {got!r}")
    assert len(set(everyone)) == 1, f"join() returned different ranks: {everyone}"
    assert got in range(SIZE), f"join() returned {got!r}"
    everyone_works("jeo.after")()


@case("join.grouped_allreduce_while_joined")
def grouped_while_joined():
    """Rank 0 has joined; the others run a mixed-dtype group three times under one name
    (negotiated in full once, then through the cache), Sum and Average."""
    specs = [("float32", (3,)), ("int32", (2, 2)), ("float64", ()), ("bfloat16", (4,))]
    active = list(range(1, SIZE))
    if RANK == 0:
        got = attempt(hvd.join)
        again = grouped_again(specs)
        check_join("join", got, LAST)
        again()
        return
    results = []
    for step in range(3):
        for op in ("Sum", "Average"):
            inputs = [[cc.op_input(f"jg.{op}.{step}.{i}", k, d, op, s) for k in range(SIZE)]
                      for i, (d, s) in enumerate(specs)]
            got = attempt(lambda: hvd.grouped_allreduce([m[RANK] for m in inputs], op=OP[op],
                                                        name=f"jg.{op}"))
            results.append((f"step {step} {op}", got,
                            [joined_expected(m, active, d, op)
                             for m, (d, _) in zip(inputs, specs)]))
    check = end_epoch("jg", LAST)
    again = grouped_again(specs)
    for label, got, exps in results:
        check_members(label, got, exps)
    check()
    again()


def check_members(label: str, got, exps: list[Expected]) -> None:
    if isinstance(got, BaseException):
        raise AssertionError(f"{label}: raised {got!r}")
    for i, (g, e) in enumerate(zip(got, exps)):
        check_array(f"{label} member {i}", g, e)


def grouped_again(specs):
    """After the epoch every rank runs the same named groups again (the previously joined
    rank cached them as a stand-in): full reductions over every rank."""
    results = []
    for op in ("Sum", "Average"):
        inputs = [[cc.op_input(f"jg.again.{op}.{i}", k, d, op, s) for k in range(SIZE)]
                  for i, (d, s) in enumerate(specs)]
        got = attempt(lambda: hvd.grouped_allreduce([m[RANK] for m in inputs], op=OP[op],
                                                    name=f"jg.{op}"))
        results.append((f"after the epoch {op}", got,
                        [allreduce_expected(m, d, op, SIZE) for m, (d, _) in zip(inputs, specs)]))
    return lambda: [check_members(*res) for res in results]


@case("join.fused_allreduces_while_joined")
def fused_while_joined():
    """Rank 0 has joined; the others have many small allreduces in flight (fused), some under
    names seen before the join (cached), some new."""
    n = 6
    before = [[cc.op_input(f"jf.pre.{i}", k, "float32", "Sum", (i + 1,)) for k in range(SIZE)]
              for i in range(n)]
    pre_h = [attempt(lambda i=i: hvd.allreduce_async(before[i][RANK], op=hvd.Sum,
                                                     name=f"jf.{i}")) for i in range(n)]
    pre_out = [finish(h) for h in pre_h]
    active = list(range(1, SIZE))
    results = []
    if RANK == 0:
        got = attempt(hvd.join)
    else:
        for step in range(2):
            ins = [[cc.op_input(f"jf.{step}.{i}", k, "float32", "Sum", (i + 1,))
                    for k in range(SIZE)] for i in range(2 * n)]
            hs = [attempt(lambda i=i: hvd.allreduce_async(
                ins[i][RANK], op=hvd.Sum if i % 2 else hvd.Average,
                name=f"jf.{i}" if i < n else f"jf.new.{step}.{i}")) for i in range(2 * n)]
            for i, h in enumerate(hs):
                results.append((f"step {step} #{i}", finish(h), joined_expected(
                    ins[i], active, "float32", "Sum" if i % 2 else "Average")))
        got = end_epoch("jf", LAST)
    for i, out in enumerate(pre_out):
        check_array(f"before join #{i}", out, allreduce_expected(before[i], "float32", "Sum",
                                                                 SIZE))
    for label, out, exp in results:
        check_array(label, out, exp)
    if RANK == 0:
        check_join("join", got, LAST)
    else:
        got()


@case("join.async_allreduce_before_join")
def async_before_join():
    """Rank 0 starts an allreduce, then joins before waiting for it; the others run another
    allreduce first (which needs rank 0 joined), then the one rank 0 started: both are right."""
    xs = [cc.op_input("jab.pre", k, "int32", "Sum", (5,)) for k in range(SIZE)]
    ys = [cc.op_input("jab.mid", k, "int32", "Sum", (3,)) for k in range(SIZE)]
    if RANK == 0:
        h = attempt(lambda: hvd.allreduce_async(xs[0], op=hvd.Sum, name="jab.pre"))
        got = attempt(hvd.join)
        pre = finish(h)
        check_array("allreduce started before join", pre,
                    allreduce_expected(xs, "int32", "Sum", SIZE))
        check_join("join", got, LAST)
        return
    mid = attempt(lambda: hvd.allreduce(ys[RANK], op=hvd.Sum, name="jab.mid"))
    pre = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name="jab.pre"))
    check = end_epoch("jab", LAST)
    check_array("allreduce after rank 0 joined", mid,
                joined_expected(ys, list(range(1, SIZE)), "int32", "Sum"))
    check_array("allreduce rank 0 started before joining", pre,
                allreduce_expected(xs, "int32", "Sum", SIZE))
    check()


@case("join.async_gather_broadcast_before_join")
def async_others_before_join():
    """Rank 0 starts an allgather (name seen before, so cached) and a broadcast, then joins:
    every rank submitted them, so they run normally although rank 0 is joined meanwhile."""
    xs = [cc.op_input("jag.x", k, "int16", "Sum", (k + 1, 2)) for k in range(SIZE)]
    warm = attempt(lambda: hvd.allgather(xs[RANK], name="jag.ag"))
    if RANK == 0:
        hg = attempt(lambda: hvd.allgather_async(xs[0], name="jag.ag"))
        hb = attempt(lambda: hvd.broadcast_async(xs[0], 0, name="jag.bc"))
        got = attempt(hvd.join)
        gathered, bcast = finish(hg), finish(hb)
        check = functools.partial(check_join, "join", got, LAST)
    else:
        gathered = attempt(lambda: hvd.allgather(xs[RANK], name="jag.ag"))
        bcast = attempt(lambda: hvd.broadcast(np.zeros((1, 2), np.int16), 0, name="jag.bc"))
        check = end_epoch("jag", LAST)
    check_exact("allgather before the join", warm, np.concatenate(xs))
    check_exact("allgather started before join", gathered, np.concatenate(xs))
    check_exact("broadcast started before join", bcast, xs[0])
    check()


# --- operations that cannot run while a rank is joined ----------------------------------------
def run_unjoinable(kind: str, name: str, joined: int):
    """Issue one ``kind`` operation under ``name`` (every participating rank the same)."""
    x = np.arange(2 * SIZE, dtype=np.float32).reshape(SIZE, 2) + RANK
    if kind == "allgather":
        return attempt(lambda: hvd.allgather(x, name=name))
    if kind == "broadcast":
        return attempt(lambda: hvd.broadcast(x, joined, name=name))
    if kind == "alltoall":
        return attempt(lambda: hvd.alltoall(x, name=name))
    if kind == "reducescatter":
        return attempt(lambda: hvd.reducescatter(x, op=hvd.Sum, name=name))
    if kind == "barrier":
        return attempt(hvd.barrier)
    if kind == "adasum":
        return attempt(lambda: hvd.allreduce(x, op=hvd.Adasum, name=name))
    if kind == "grouped_allgather":
        return attempt(lambda: hvd.grouped_allgather([x, x[:1]], name=name))
    raise ValueError(kind)


UNJOINABLE = ["allgather", "broadcast", "alltoall", "reducescatter", "barrier",
              "grouped_allgather", "adasum"]


def unjoinable_case(name: str, kind: str, cached: bool) -> None:
    """One rank has joined; the others submit ``kind``: it fails on them with an error saying
    which ranks have joined, the joined rank's join() still returns when the others join, and
    the same operation works once nobody is joined any more."""
    joined = 1 if cached else 0
    submitters = [k for k in range(SIZE) if k != joined]
    last = max(submitters)
    warm = run_unjoinable(kind, name, joined) if cached else None   # everyone: now cached
    if RANK == joined:
        out = None
        check = None
        got = attempt(hvd.join)
    else:
        out = run_unjoinable(kind, name, joined)
        check = end_epoch(name, last)
    after = run_unjoinable(kind, name, joined)
    if cached and isinstance(warm, BaseException):
        raise AssertionError(f"{kind} before the join raised {warm!r}")
    if RANK == joined:
        check_join("join on the joined rank", got, last)
    else:
        if not isinstance(out, hvd.HvdliteError):
            raise AssertionError(f"{kind} while rank {joined} is joined: expected an "
                                 f"HvdliteError, got {out!r}")
        msg = str(out)
        assert f"ranks {[joined]} have" in msg and "join" in msg, (
            f"message does not say rank {joined} has joined: {msg}")
        if kind not in ("barrier", "grouped_allgather"):
            assert name in msg, f"message does not name {name!r}: {msg}"
        check()
    if isinstance(after, BaseException):
        raise AssertionError(f"{kind} after everyone left join() raised {after!r}")


for _kind in UNJOINABLE:
    for _cached in (False, True):
        _name = f"join.unjoinable.{_kind}.{'cached' if _cached else 'fresh'}"
        register(_name, functools.partial(unjoinable_case, _name, _kind, _cached),
                 when=pow2 if _kind == "adasum" else always)


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
