"""The hierarchical allreduce and allgather across hosts (tests/multihost/test_hierarchical.py),
exact against numpy, with the path's own counters as evidence that it ran.

Launched with HVDLITE_HIERARCHICAL_ALLREDUCE=1 and HVDLITE_HIERARCHICAL_ALLGATHER=1, and
HVDLITE_TEST_EXPECT (JSON): ``hosts``, the global ranks of each host in rank order, and
``subset``, the ranks of a process set that spans hosts.  Cases (see :func:`cases`):

* ``allreduce.<op>.<dtype>.<kind>``: every op and dtype (a dtype of each size and kind for the
  bigger kinds), for each kind of batch the path runs differently: ``single`` and ``fused`` (one
  small tensor, a small fused batch, under 64 KiB: the path leaves them to MPI's flat allreduce,
  and the counters check that it did), ``mid_single`` (one tensor of 64 KiB to 1 MiB, in place and
  out of place: shares, reduced and gathered within the host by MPI), ``big_fused`` (a fused batch
  of 64 KiB or more: shares, through the host's shared-memory window) and ``big_single`` (one
  tensor of 2 MiB or more, in place and out of place: direct copies between the host's ranks,
  where the kernel allows them, else the window without a pack). Sizes are odd, so shares and
  segments are uneven;
* ``scaled.<op>.<dtype>.<kind>``: prescale and postscale (Sum and Average);
* ``scalar.<op>``: a 0-d array, in place and out of place (a 0-d array's flat view is a new
  object each time: in place must still be recognised);
* ``nowindow.<kind>``: the window and the direct copies taken away (as HVDLITE_SHM_WINDOW_MB=0
  and HVDLITE_DIRECT_COPIES=0 do) on every host, and on the first host only (hosts may differ in how they
  reduce within themselves): MPI's reduce-scatter and allgather within the host;
* ``join.<who>.<kind>``: the last rank, or every rank of the last host, has joined; the others
  reduce with them standing in (the identity, never prescaled);
* ``allgather.<dtype>.<kind>``: uneven first dimensions (a rank with none), small (under
  64 KiB in all: MPI's allgather, the path stays out) and large;
* ``identical.<op>``: random floats: every rank receives the same bits;
* ``subset.<kind>``: the same on a process set that spans hosts (its own engine and path);
* ``off``: with the path switched off, allreduces and allgathers (large ones too) take MPI's
  flat collectives, exact as well (the path's counters unchanged);
* ``counters``: the path ran every batch it should, and its host steps went by direct copies,
  through the window and through MPI on hosts with several ranks, none of these on hosts with
  one;
* ``copy_fails`` (launched alone, ``multihost_hier_worker.py copy_fails``: it stops the
  engine): a direct copy fails on one rank of a host; every rank of the set raises, naming
  that rank, also on the other hosts, which received the incomplete share.

Importable without MPI for the case list.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from tests.workers import core_cases as cc  # noqa: E402
from tests.workers.core_refs import (allreduce_expected, attempt, check_array,  # noqa: E402
                                     check_exact, digest)

KINDS = ("single", "fused", "mid_single", "big_fused", "big_single")
# bytes of each kind's tensors: (several, for fused kinds) odd counts of elements
SIZES = {"single": (4099,), "fused": (1200, 52, 3001), "mid_single": (200001,),
         "big_fused": (40001, 7, 60009),
         "big_single": ((2 << 20) + 4099,)}
SCALED_DTYPES = ("uint8", "int32", "float16", "bfloat16", "float32", "float64")
BIG_DTYPES = ("bool", "uint8", "int32", "float16", "bfloat16", "float64")
GATHER_DTYPES = ("bool", "uint8", "int32", "float16", "float64")
GATHER_ROWS = {"small": 5, "big": 70001}   # row length; first dimensions differ per rank


def cases() -> list[str]:
    # The big kinds combine with numpy's ufuncs, the same code for every dtype: a dtype of each
    # item size and kind of arithmetic is enough there (MPI's own reductions get every dtype).
    names = [f"allreduce.{op}.{dt}.{kind}" for op in cc.OPS for kind in KINDS
             for dt in (cc.DTYPES if kind in ("single", "fused") else BIG_DTYPES)
             if not (dt == "bool" and op == "Average")]
    names += [f"scaled.{op}.{dt}.{kind}" for op in ("Sum", "Average") for dt in SCALED_DTYPES
              for kind in KINDS]
    names += [f"scalar.{op}" for op in cc.OPS]
    names += [f"nowindow.{where}.{kind}" for where in ("all", "first") for kind in KINDS]
    names += [f"join.{who}.{kind}" for who in ("rank", "host") for kind in KINDS]
    names += [f"allgather.{dt}.{kind}" for dt in GATHER_DTYPES for kind in GATHER_ROWS]
    names += [f"identical.{op}" for op in ("Sum", "Average")]
    names += [f"subset.{kind}" for kind in KINDS] + ["subset.allgather", "off", "counters"]
    return names


def elements(kind: str, dtype: str) -> list[int]:
    """Element counts of a kind's tensors: its byte sizes over the dtype's item size (odd)."""
    itemsize = cc.np_dtype(dtype).itemsize
    return [max(1, n // itemsize) | 1 for n in SIZES[kind]]


if __name__ == "__main__":
    import hvdlite as hvd
    from hvdlite.common.data_paths.hier_plan import SMALL_BYTES
    from hvdlite.common.runtime import registry
    from tests.workers._report import Reporter

    EXPECT = json.loads(os.environ["HVDLITE_TEST_EXPECT"])
    HOSTS = [list(h) for h in EXPECT["hosts"]]
    SUBSET = hvd.ProcessSet(EXPECT["subset"])
    hvd.init(process_sets=[SUBSET])
    from mpi4py import MPI   # after init: under torchrun, init() forms the MPI world
    RANK, SIZE = hvd.rank(), hvd.size()
    world = MPI.COMM_WORLD
    OP = {name: getattr(hvd, name) for name in cc.OPS}
    r = Reporter(RANK)
    MY_HOST = next(i for i, ranks in enumerate(HOSTS) if RANK in ranks)

    def path_of(process_set):
        return registry.process_set_engine(process_set, "test")[0].path("hierarchical")

    PATH = path_of(hvd.global_process_set)
    expected_runs = {"global": 0, "allgathers": 0}   # batches the path must have run

    def inputs(case: str, dtype: str, op: str, n: int, ranks=None) -> list[np.ndarray]:
        ranks = range(SIZE) if ranks is None else ranks
        return [cc.op_input(case, g, dtype, op, (n,)) for g in ranks]

    def run_kind(case: str, kind: str, dtype: str, op: str, pre: float = 1.0,
                 post: float = 1.0, active=None, process_set=None, ranks=None):
        """Submit a kind's batch (if this rank is active) and return (results, expectations).
        ``active``: the ranks that submit (the others have joined); ``ranks``: the set."""
        ranks = list(range(SIZE)) if ranks is None else ranks
        active = ranks if active is None else active
        size = len(ranks)
        kw = dict(op=OP[op], prescale_factor=pre, postscale_factor=post)
        if process_set is not None:
            kw["process_set"] = process_set
        per_tensor = [inputs(f"{case}.{i}", dtype, op, n, ranks)
                      for i, n in enumerate(elements(kind, dtype))]
        want = []
        for xs in per_tensor:
            mine = [xs[ranks.index(g)] for g in active]
            if op == "Average":   # joined ranks count in Average's divisor
                want.append(allreduce_expected(mine, dtype, "Sum", size, pre, post / size))
            else:
                want.append(allreduce_expected(mine, dtype, op, size, pre, post))
        if RANK not in active:
            return None, want
        me = ranks.index(RANK)
        if kind in ("fused", "big_fused"):
            got = attempt(lambda: hvd.grouped_allreduce([xs[me] for xs in per_tensor],
                                                        name=case, **kw))
            return got, want
        x = per_tensor[0][me]
        if kind == "single":
            return [attempt(lambda: hvd.allreduce(x, name=case, **kw))], want
        y = x.copy()   # out of place and in place, one after the other: each its own batch
        got_out = attempt(lambda: hvd.allreduce(x, name=case + ".out", **kw))
        got_in = attempt(lambda: hvd.allreduce_(y, name=case + ".in", **kw))
        if got_in is not y and not isinstance(got_in, BaseException):
            got_in = AssertionError("allreduce_ did not return its input")
        return [got_out, got_in], want + want

    def runs_of(kind: str) -> int:
        """Batches the path runs for a kind (batches under 64 KiB are MPI's)."""
        return {"single": 0, "fused": 0, "mid_single": 2, "big_single": 2}.get(kind, 1)

    def check(case: str, got, want) -> None:
        if isinstance(got, BaseException):
            raise AssertionError(f"{case}: raised {type(got).__name__}: {got}")
        assert len(got) == len(want), f"{case}: {len(got)} results for {len(want)} tensors"
        for i, (g, w) in enumerate(zip(got, want)):
            check_array(f"{case}[{i}]", g, w)

    def allreduce_case(case: str, op: str, dtype: str, kind: str, pre=1.0, post=1.0) -> None:
        got, want = run_kind(case, kind, dtype, op, pre, post)
        expected_runs["global"] += runs_of(kind)
        check(case, got, want)

    def scalar(case: str, op: str) -> None:
        xs = [cc.op_input(case, g, "int32", op, ()) for g in range(SIZE)]
        want = allreduce_expected(xs, "int32", op, SIZE)
        got_out = attempt(lambda: hvd.allreduce(xs[RANK], op=OP[op], name=case + ".out"))
        y = xs[RANK].copy()
        got_in = attempt(lambda: hvd.allreduce_(y, op=OP[op], name=case + ".in"))
        check(case, [got_out, y if got_in is y else got_in], [want, want])   # (MPI's: small)

    def nowindow(case: str, where: str, kind: str) -> None:
        """The window taken away on every host or on the first only, at a point every rank
        reaches alike (nothing in flight after the barrier)."""
        hvd.barrier()
        saved = PATH.window, PATH.direct
        if where == "all" or MY_HOST == 0:
            PATH.window = PATH.direct = None
        try:
            got, want = run_kind(case, kind, "float32", "Sum", 2.0, 0.5)
        finally:
            hvd.barrier()
            PATH.window, PATH.direct = saved
        expected_runs["global"] += runs_of(kind)
        check(case, got, want)

    def join_case(case: str, who: str, kind: str) -> None:
        """``who`` joins first; the others run the kind's batches for three ops, then join."""
        joined = [SIZE - 1] if who == "rank" else HOSTS[-1]
        active = [g for g in range(SIZE) if g not in joined]
        results = []
        if RANK in joined:
            last = attempt(hvd.join)
        specs = (("Sum", "float32", 2.0, 0.5), ("Min", "int32", 1.0, 1.0),
                 ("Product", "float64", 1.0, 1.0), ("Average", "float64", 1.0, 1.0))
        for i, (op, dtype, pre, post) in enumerate(specs):
            results.append(run_kind(f"{case}.{i}", kind, dtype, op, pre, post, active=active))
        if RANK not in joined:
            last = attempt(hvd.join)
        if isinstance(last, BaseException):
            raise AssertionError(f"{case}: join() raised {last!r}")
        expected_runs["global"] += len(specs) * runs_of(kind)
        if RANK in active:
            for i, (got, want) in enumerate(results):
                check(f"{case}.{specs[i][0]}", got, want)

    def allgather_case(case: str, dtype: str, kind: str) -> None:
        row = GATHER_ROWS[kind]
        firsts = [0 if g == 1 else g % 3 + 1 for g in range(SIZE)]
        xs = [cc.op_input(case, g, dtype, "Sum", (firsts[g], row)) for g in range(SIZE)]
        got = attempt(lambda: hvd.allgather(xs[RANK], name=case))
        if kind == "big":   # a small allgather (under 64 KiB in all) is MPI's own
            expected_runs["allgathers"] += 1
        check_exact(case, got, np.concatenate(xs))

    def identical(case: str, op: str) -> None:
        rng = np.random.default_rng([cc.seed_of(case), RANK])
        results = []
        for kind in KINDS:
            n = elements(kind, "float32")[0]
            x = rng.standard_normal(n).astype(np.float32)
            results.append(attempt(lambda: hvd.allreduce(x, op=OP[op], name=f"{case}.{kind}")))
            expected_runs["global"] += x.nbytes >= SMALL_BYTES
        digests = world.allgather([digest(g) for g in results])
        for g in results:
            if isinstance(g, BaseException):
                raise AssertionError(f"{case}: raised {g!r}")
        assert all(d == digests[0] for d in digests), f"{case}: ranks differ: {digests}"

    def subset_case(case: str, kind: str) -> None:
        ranks = EXPECT["subset"]
        if RANK not in ranks:
            return
        before = path_of(SUBSET).allreduces
        got, want = run_kind(case, kind, "float32", "Average", 0.5, 3.0, process_set=SUBSET,
                             ranks=ranks)
        check(case, got, want)
        ran = path_of(SUBSET).allreduces - before
        assert ran == runs_of(kind), f"{case}: the subset's path ran {ran} batches"

    def subset_allgather(case: str) -> None:
        ranks = EXPECT["subset"]
        if RANK not in ranks:
            return
        before = path_of(SUBSET).allgathers
        xs = [cc.op_input(case, g, "int64", "Sum", (g + 1, 3001)) for g in ranks]
        got = attempt(lambda: hvd.allgather(xs[ranks.index(RANK)], name=case,
                                            process_set=SUBSET))
        check_exact(case, got, np.concatenate(xs))
        assert path_of(SUBSET).allgathers - before == 1, f"{case}: not through the path"

    def off(case: str) -> None:
        """Both switched off: MPI's flat collectives over every rank (the large ones waited
        for inside MPI), exact as well; the path runs nothing."""
        hvd.barrier()
        before = PATH.allreduces, PATH.allgathers
        PATH.allreduce_on = PATH.allgather_on = False
        try:
            results = [run_kind(f"{case}.{kind}", kind, "int64", "Sum")
                       for kind in ("big_fused", "big_single")]
            xs = [cc.op_input(case, g, "float32", "Sum", (g + 1, 1 << 17)) for g in range(SIZE)]
            gathered = attempt(lambda: hvd.allgather(xs[RANK], name=f"{case}.gather"))
        finally:
            hvd.barrier()
            PATH.allreduce_on = PATH.allgather_on = True
        for i, (got, want) in enumerate(results):
            check(f"{case}.{i}", got, want)
        check_exact(f"{case}.gather", gathered, np.concatenate(xs))
        assert (PATH.allreduces, PATH.allgathers) == before, f"{case}: the path ran while off"

    mismatches = {}   # case -> (batches the path ran, batches expected), where they differ

    def counters(case: str) -> None:
        assert PATH.allreduces == expected_runs["global"] and not mismatches, (
            f"rank {RANK}: the hierarchical path ran {PATH.allreduces} allreduce batches, "
            f"expected {expected_runs['global']}; (ran, expected) per case: {mismatches}")
        assert PATH.allgathers == expected_runs["allgathers"], (
            f"rank {RANK}: {PATH.allgathers} allgathers, expected {expected_runs['allgathers']}")
        several = len(HOSTS[MY_HOST]) > 1
        copies = several and cc.direct_copies_expected(PATH)
        got = (PATH.by_copies > 0, PATH.by_window > 0, PATH.by_mpi > 0)
        assert got == (copies, several, several), (
            f"rank {RANK} on a host of {len(HOSTS[MY_HOST])}: (by copies, through the window, "
            f"through MPI) = ({PATH.by_copies}, {PATH.by_window}, {PATH.by_mpi})")
        assert PATH.local_size == len(HOSTS[MY_HOST])
        assert [list(m) for m in PATH.hosts.members] == HOSTS

    def copy_fails(case: str) -> None:
        """Rank 1 of the first host with several ranks fails its copies from its peers."""
        victim_host = next(i for i, h in enumerate(HOSTS) if len(h) > 1)
        victim = HOSTS[victim_host][1]
        here = PATH.direct is not None and PATH.direct.available
        if not world.allreduce(here and MY_HOST == victim_host, op=MPI.LOR):
            return   # this machine forbids direct copies (counters says whether that is allowed)
        if RANK == victim:
            def failing(pid, address, dst):
                raise OSError(errno.EPERM, f"process_vm_readv in process {pid}: injected")
            PATH.direct._copier.read = failing
        work = inputs(case, "float32", "Sum", elements("big_single", "float32")[0])[RANK]
        try:
            hvd.allreduce_(work, op=hvd.Sum, name=case)
        except hvd.HorovodInternalError as exc:
            msg = str(exc)
        else:
            raise AssertionError(f"{case}: the allreduce whose copy failed returned normally")
        for part in (repr(case), f"rank(s) [{victim}]", "incomplete"):
            assert part in msg, f"{part!r} missing from: {msg}"
        assert ("injected" in msg) == (RANK == victim), msg
        assert ("on another host" in msg) == (MY_HOST != victim_host), msg

    def placement_ok() -> None:   # the layout the test expects is the one we run on
        names = world.allgather(socket.gethostname())
        by_host = {}
        for g, name in enumerate(names):
            by_host.setdefault(name, []).append(g)
        assert sorted(by_host.values()) == sorted(HOSTS), f"placement {by_host} != {HOSTS}"

    def run_case(name: str) -> None:
        parts = name.split(".")
        if parts[0] == "allreduce":
            r.case(name, allreduce_case, name, parts[1], parts[2], parts[3])
        elif parts[0] == "scaled":
            r.case(name, allreduce_case, name, parts[1], parts[2], parts[3], 0.5, 3.0)
        elif parts[0] == "scalar":
            r.case(name, scalar, name, parts[1])
        elif parts[0] == "nowindow":
            r.case(name, nowindow, name, parts[1], parts[2])
        elif parts[0] == "join":
            r.case(name, join_case, name, parts[1], parts[2])
        elif parts[0] == "allgather":
            r.case(name, allgather_case, name, parts[1], parts[2])
        elif parts[0] == "identical":
            r.case(name, identical, name, parts[1])
        elif name == "subset.allgather":
            r.case(name, subset_allgather, name)
        elif parts[0] == "subset":
            r.case(name, subset_case, name, parts[1])
        elif name == "off":
            r.case(name, off, name)
        else:
            r.case(name, counters, name)

    placement_ok()
    if sys.argv[1:] == ["copy_fails"]:
        r.case("copy_fails", copy_fails, "copy_fails")
        r.write()
        hvd.shutdown()
        sys.exit(0)
    for name in cases():
        ran, expected = PATH.allreduces, expected_runs["global"]
        run_case(name)
        ran, expected = PATH.allreduces - ran, expected_runs["global"] - expected
        if ran != expected:
            mismatches[name] = (ran, expected)
    r.write()
    world.Barrier()   # ranks outside the subset finish first: shut down together
    hvd.shutdown()

