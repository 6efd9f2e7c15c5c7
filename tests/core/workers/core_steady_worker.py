"""Repeated training-like steps with the same tensor names (the response cache's steady state),
names whose shape/dtype/op/scale/kind/root change between steps (cache invalidation), and batches
that fuse or split.  Run under several HVDLITE_FUSION_THRESHOLD / HVDLITE_CACHE_CAPACITY settings:
every configuration must give the numpy reference results.

argv[1]: configuration name (a key of core_cases.STEADY_CONFIGS).
"""
import gc
import sys

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from hvdlite.common.runtime import state
from hvdlite.common.intranode import direct_copies as direct_allreduce
from hvdlite.common.memory import result_pool
from tests.workers import core_cases as cc
from tests.workers.nodes import host_of_rank, intranode, on_one_node
from tests.workers.core_refs import (allreduce_expected, attempt, check_array, check_exact,
                                     noncontiguous)
from tests.workers._report import Reporter

CONFIG = sys.argv[1]
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
r = Reporter(RANK)
# The intra-node paths serve the job only where all its ranks share a node (tests/multihost).
ONE_NODE = on_one_node(host_of_rank(MPI.COMM_WORLD), range(SIZE))
OP = {name: getattr(hvd, name) for name in cc.OPS}


def inp(tag, rank, dtype, op, shape):
    return cc.op_input(tag, rank, dtype, op, shape)


def run_allreduces(specs, step, in_place=False, order=None):
    """specs: list of (name, dtype, op, shape, pre, post); all async, then wait; check all.
    ``in_place``: True, False, or "mixed" (every other spec in place, alternating by step)."""
    inputs = {s[0]: [inp(f"{s[0]}@{step}", k, s[1], s[2], s[3]) for k in range(SIZE)]
              for s in specs}
    if in_place == "mixed":
        in_place = {s[0]: (i + step) % 2 == 1 for i, s in enumerate(specs)}
    else:
        in_place = dict.fromkeys((s[0] for s in specs), in_place)
    handles = {}
    arrays = {}
    for s in (order or specs):
        name, dtype, op, shape, pre, post = s
        x = inputs[name][RANK].copy()
        arrays[name] = x
        fn = hvd.allreduce_async_ if in_place[name] else hvd.allreduce_async
        handles[name] = attempt(lambda: fn(x, name=name, op=OP[op], prescale_factor=pre,
                                           postscale_factor=post))
    got = {n: (h if isinstance(h, Exception) else attempt(h.wait)) for n, h in handles.items()}
    for name, dtype, op, shape, pre, post in specs:
        exp = allreduce_expected(inputs[name], dtype, op, SIZE, pre, post)
        check_array(f"step {step} {name}", got[name], exp)
        if in_place[name]:
            check_array(f"step {step} {name} (array)", arrays[name], exp)


def config_applied():
    cfg = state.engine().config
    env = cc.STEADY_CONFIGS[CONFIG]
    want_fusion = int(env.get("HVDLITE_FUSION_THRESHOLD",
                              env.get("HOROVOD_FUSION_THRESHOLD", 128 * 1024 * 1024)))
    want_cache = int(env.get("HVDLITE_CACHE_CAPACITY", env.get("HOROVOD_CACHE_CAPACITY", 1024)))
    assert cfg.fusion_threshold == want_fusion, (cfg.fusion_threshold, want_fusion)
    assert cfg.cache_capacity == want_cache, (cfg.cache_capacity, want_cache)
    want_shm = int(float(env.get("HVDLITE_SHM_WINDOW_MB", 64)) * 2**20)
    assert cfg.shm_window_bytes == want_shm, (cfg.shm_window_bytes, want_shm)
    want_cma = {"0": "off"}.get(env.get("HVDLITE_DIRECT_COPIES", "auto"), "auto")
    assert cfg.direct_copies == want_cma, (cfg.direct_copies, want_cma)
    want_pool = float(env.get("HVDLITE_RESULT_POOL_MB", 512)) * 2**20
    assert result_pool().max_idle_bytes == want_pool, (result_pool().max_idle_bytes, want_pool)


def same_names_mixed():
    dtypes = ["float32", "float64", "int32", "float16", "int64", "bfloat16"]
    ops = ["Sum", "Average", "Max", "Min"]
    sizes = [1, 10, 100, 1000, 3000]
    specs = []
    for i in range(30):
        pre, post = ((0.5, 2.0) if i % 7 == 0 else (1.0, 1.0))
        specs.append((f"smm.{i}", dtypes[i % len(dtypes)], ops[i % len(ops)],
                      (sizes[i % len(sizes)],), pre, post))
    for step in range(8):
        run_allreduces(specs, step)


def many_steps_cached():
    specs = [(f"msc.{i}", "float32", "Sum", (i + 1, 3), 1.0, 1.0) for i in range(16)]
    for step in range(40):
        run_allreduces(specs, step, in_place=True)


def shape_change():
    shapes = [(4,), (4,), (6,), (6,), (2, 3), (4,), (0,), (4,), ()]
    for step, shape in enumerate(shapes):
        run_allreduces([("sc.w", "int64", "Sum", shape, 1.0, 1.0)], step)
        b = [inp(f"sc.b@{step}", k, "float32", "Sum", shape) for k in range(SIZE)]
        check_exact(f"step {step} broadcast", attempt(lambda: hvd.broadcast(b[RANK], 0,
                                                                               name="sc.b")),
                    b[0])


def shape_change_one_rank_first_dim():
    for step in range(8):
        def rows(k):
            return 2 if k != SIZE - 1 else (step * 5) % 4   # only the last rank's rows change
        xs = [inp(f"scg@{step}", k, "int32", "Sum", (rows(k), 3)) for k in range(SIZE)]
        got = attempt(lambda: hvd.allgather(xs[RANK], name="scg"))

        def rows0(k):
            return (step % 3) if k == 0 else 1     # only rank 0's rows change
        ys = [inp(f"scg0@{step}", k, "uint16", "Sum", (rows0(k),)) for k in range(SIZE)]
        got0 = attempt(lambda: hvd.allgather(ys[RANK], name="scg0"))
        check_exact(f"step {step}", got, np.concatenate(xs))
        check_exact(f"step {step} (rank 0 changes)", got0, np.concatenate(ys))


def dtype_change():
    for step, dtype in enumerate(["float32", "float32", "int64", "float16", "int64", "bool",
                                  "float32"]):
        op = "Max" if dtype == "bool" else "Sum"
        run_allreduces([("dc", dtype, op, (5,), 1.0, 1.0)], step)


def op_change():
    for step, op in enumerate(["Sum", "Sum", "Max", "Min", "Average", "Product", "Sum"]):
        run_allreduces([("oc", "int32", op, (6,), 1.0, 1.0), ("oc2", "float64", op, (3,),
                                                               1.0, 1.0)], step)


def scale_change():
    factors = [(1.0, 1.0), (1.0, 1.0), (0.5, 1.0), (0.5, 2.0), (0.5, 2.0), (1.0, 1.0), (3.0, 0.5)]
    for step, (pre, post) in enumerate(factors):
        run_allreduces([("scl.i", "int16", "Sum", (6,), pre, post),
                        ("scl.f", "float32", "Average", (6,), pre, post)], step)


def kind_change():
    for step, kind in enumerate(["allreduce", "allreduce", "broadcast", "broadcast", "allgather",
                                 "allreduce", "allgather"]):
        xs = [inp(f"kc@{step}", k, "float64", "Sum", (3,)) for k in range(SIZE)]
        if kind == "allreduce":
            got = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name="kc"))
            check_array(f"step {step}", got, allreduce_expected(xs, "float64", "Sum", SIZE))
        elif kind == "broadcast":
            got = attempt(lambda: hvd.broadcast(xs[RANK], SIZE - 1, name="kc"))
            check_exact(f"step {step}", got, xs[SIZE - 1])
        else:
            got = attempt(lambda: hvd.allgather(xs[RANK], name="kc"))
            check_exact(f"step {step}", got, np.concatenate(xs))


def root_change():
    for step, root in enumerate([0, 0, 1, SIZE - 1, SIZE - 1, 0]):
        xs = [inp(f"rc@{step}", k, "int8", "Sum", (4,)) for k in range(SIZE)]
        y = xs[RANK].copy()
        got = attempt(lambda: hvd.broadcast_(y, root, name="rc"))
        check_exact(f"step {step} root {root}", got, xs[root])


def large_and_small():
    sizes = [10, 2000, 5, 1500, 100000, 3, 1024, 1023, 1, 700, 700]
    specs = [(f"las.{i}", "float32", "Sum", (n,), 1.0, 1.0) for i, n in enumerate(sizes)]
    specs += [(f"las.d{i}", "float64", "Sum", (n,), 1.0, 1.0) for i, n in enumerate(sizes[:4])]
    for step in range(3):
        run_allreduces(specs, step)
        run_allreduces(specs, step + 100, in_place=True)


def fused_scaled():
    """Same-key groups with scale factors (these fuse), next to unscaled ones of the same dtype
    (a different fusion key), in-place and out-of-place."""
    specs = []
    for i in range(16):
        dtype = ["float32", "int32"][i % 2]
        op = ["Sum", "Average"][(i // 2) % 2]
        pre, post = [(0.5, 3.0), (1.0, 1.0), (2.5, 0.25), (0.5, 3.0)][(i // 4) % 4]
        specs.append((f"fs.{i}", dtype, op, (i % 5 + 1, 3), pre, post))
    for step in range(3):
        run_allreduces(specs, step)
        run_allreduces(specs, step + 50, in_place=True)


def inplace_and_noncontiguous_fused():
    for step in range(4):
        xs = [[inp(f"inc{i}@{step}", k, "float32", "Sum", (6, 4)) for k in range(SIZE)]
              for i in range(6)]
        views, handles = [], []
        for i in range(6):
            x = xs[i][RANK]
            if i % 2 == 0:
                view = noncontiguous(x)[0]       # Fortran-ordered copy: not C-contiguous
                assert not view.flags.c_contiguous
                views.append(view)
                handles.append(hvd.allreduce_async_(view, op=hvd.Sum, name=f"inc.{i}"))
            else:
                views.append(None)
                handles.append(hvd.allreduce_async(x, op=hvd.Sum, name=f"inc.{i}"))
        got = [attempt(h.wait) for h in handles]
        for i in range(6):
            exp = allreduce_expected(xs[i], "float32", "Sum", SIZE)
            check_array(f"step {step} tensor {i}", got[i], exp)
            if views[i] is not None:
                assert got[i] is views[i]
                assert np.array_equal(views[i], exp.exact)


def unnamed():
    for step in range(3):
        xs = [[inp(f"un{i}@{step}", k, "int32", "Sum", (i + 1,)) for k in range(SIZE)]
              for i in range(10)]
        handles = [hvd.allreduce_async(xs[i][RANK], op=hvd.Sum) for i in range(10)]
        for i, h in enumerate(handles):
            check_array(f"step {step} tensor {i}", attempt(h.wait),
                        allreduce_expected(xs[i], "int32", "Sum", SIZE))


def more_names_than_cache():
    specs = [(f"mntc.{i}", "int64", "Max", (i + 1,), 1.0, 1.0) for i in range(10)]
    for step in range(5):
        run_allreduces(specs, step)
        for s in specs[::3]:   # some names also alone, synchronously
            xs = [inp(f"{s[0]}#{step}", k, "int64", "Max", s[3]) for k in range(SIZE)]
            got = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Max, name=s[0]))
            check_array(f"step {step} {s[0]} alone", got,
                        allreduce_expected(xs, "int64", "Max", SIZE))


def out_of_order_repeated():
    specs = [(f"oor.{i}", ["float32", "int32", "uint8"][i % 3], ["Sum", "Max", "Min"][i % 3],
              (i % 4 + 1,), 1.0, 1.0) for i in range(20)]
    for step in range(6):
        rng = np.random.default_rng([step, RANK])
        order = [specs[i] for i in rng.permutation(len(specs))]
        run_allreduces(specs, step, order=order)


def pooled_results():
    """Large results (>= 256 KiB) come from the result pool: every result 64-byte aligned and
    correct, a result still alive is never handed out again (old results kept across steps
    stay intact), and dropped ones are reused (pool hits) unless the pool is off."""
    pool = result_pool()
    hits_before = pool.hits
    kept = []
    for step in range(6):
        xs = [inp(f"pool@{step}", k, "float32", "Sum", (300, 257)) for k in range(SIZE)]
        got = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name="pool.ar"))
        exp = allreduce_expected(xs, "float32", "Sum", SIZE)
        check_array(f"step {step} allreduce", got, exp)
        gathered = attempt(lambda: hvd.allgather(xs[RANK], name="pool.ag"))
        check_exact(f"step {step} allgather", gathered, np.concatenate(xs))
        for name, arr in (("allreduce", got), ("allgather", gathered)):
            assert arr.ctypes.data % 64 == 0, f"step {step} {name} result not 64-byte aligned"
        if step % 2 == 0:   # keep every other step's result alive until the end
            kept.append((step, got, exp))
        del got, gathered
    for step, arr, exp in kept:
        check_array(f"result of step {step}, kept while later steps ran", arr, exp)
    gc.collect()
    if float(cc.STEADY_CONFIGS[CONFIG].get("HVDLITE_RESULT_POOL_MB", 512)) > 0:
        assert pool.hits > hits_before, "no result block was ever reused"
    else:
        assert pool.hits == hits_before and pool.idle_bytes == 0, "pool used although off"


def shared_fusion():
    """Fused batches of 64 KiB or more are reduced through the intra-node shared-memory window
    (unless fusion or the window is off): every dtype and op against numpy, outputs straddling
    the ranks' shares, scale factors, ranks arriving at different times, several batches back
    to back (the two slots alternate) and a window that grows between steps."""
    import time
    shared = intranode(state.engine()).shared
    before = 0 if shared is None else shared.batches
    # 79,490 elements: even a 1-byte dtype fuses to >= 64 KiB; no single output reaches 1 MiB
    shapes = [(1,), (33, 7), (9000,), (0,), (17, 3, 5), (70000,), (3,)]
    step = 0
    for dtype in cc.DTYPES:
        specs = [(f"shf.{dtype}.{op}.{i}", dtype, op, shape, 1.0, 1.0)
                 for op in cc.OPS if not (dtype == "bool" and op == "Average")
                 for i, shape in enumerate(shapes)]
        if RANK == SIZE - 1:
            time.sleep(0.005)   # the last rank arrives late: the others wait at the barriers
        # one batch per op, back to back; in-place and out-of-place members mixed (an
        # in-place member at two ranks is combined from its input, not its packed copy)
        run_allreduces(specs, step, in_place="mixed")
        step += 1
    for dtype in ("float32", "int32", "float16"):
        specs = [(f"shf.scaled.{dtype}.{op}.{i}", dtype, op, shape, 0.5, 3.0)
                 for op in ("Sum", "Average") for i, shape in enumerate(shapes)]
        run_allreduces(specs, step, in_place="mixed")
        step += 1
    # Groups are negotiated in one round, so each is exactly one fused batch: 0.3 MiB, 3.1 MiB,
    # then 12 x 1,000,000 bytes (the window grows).
    for count, n in ((20, 4096), (200, 4096), (12, 250000)):
        xs = [[inp(f"shf.grow.{count}.{i}", k, "float32", "Sum", (n,)) for k in range(SIZE)]
              for i in range(count)]
        got = attempt(lambda: hvd.grouped_allreduce([x[RANK] for x in xs], op=hvd.Sum,
                                                    name=f"shf.grow.{count}"))
        assert not isinstance(got, Exception), got
        for i, (x, g) in enumerate(zip(xs, got)):
            check_array(f"group of {count}, member {i}", g,
                        allreduce_expected(x, "float32", "Sum", SIZE))
    env = cc.STEADY_CONFIGS[CONFIG]
    fusion = int(env.get("HVDLITE_FUSION_THRESHOLD",
                         env.get("HOROVOD_FUSION_THRESHOLD", 128 * 1024 * 1024)))
    if float(env.get("HVDLITE_SHM_WINDOW_MB", 64)) == 0:
        assert shared is None, "shared-memory fusion exists although HVDLITE_SHM_WINDOW_MB=0"
    elif not ONE_NODE:
        assert shared.batches == before, "batches of ranks on several hosts used the window"
    elif fusion >= 1 << 20:
        assert shared.batches >= before + 3, \
            f"only {shared.batches - before} fused batches went through shared memory"
        # (the largest ever: a peer that is done may already have shut the window down)
        assert shared.largest_slot_bytes >= 12 * 10**6, "the window did not grow for 12 MB"
    else:
        assert shared.batches == before, "batches above the fusion threshold used the window"


def large_single():
    """A single allreduce of 2 MiB or more takes an intra-node path: direct copies between the
    ranks' memory (cross-memory attach), or with HVDLITE_DIRECT_COPIES=0 the shared-memory window without
    a pack (each rank publishes only its peers' shares), or with that off too, MPI.  Every dtype
    and op against numpy, in place and out of place, odd counts whose shares straddle cache
    lines and chunks, a 3-D shape, scale factors, and a late rank."""
    import time
    backend = intranode(state.engine())
    env = cc.STEADY_CONFIGS[CONFIG]
    cma_on = env.get("HVDLITE_DIRECT_COPIES", "auto") != "0"
    shm_on = float(env.get("HVDLITE_SHM_WINDOW_MB", 64)) != 0
    counters = (backend.direct, backend.shared)
    before = [0 if c is None else c.singles for c in counters]
    expected = 0
    for step, dtype in enumerate(cc.DTYPES):
        count = (2 << 20) // np.dtype(cc.np_dtype(dtype)).itemsize + 37   # >= 2 MiB, odd
        shape = (count,) if step % 3 else (37, 1, count // 37 + 1)
        specs = [(f"shs.{dtype}.{op}", dtype, op, shape, 1.0, 1.0)
                 for op in cc.OPS if not (dtype == "bool" and op == "Average")]
        if RANK == SIZE - 1 and step % 2:
            time.sleep(0.005)   # the last rank arrives late: the others wait for it
        run_allreduces(specs, step, in_place=step % 2 == 1)
        expected += len(specs)
    # Shares of several copy chunks each, ending in a partial one (the sizes above give every
    # rank one chunk's worth or less).
    for i, dtype in enumerate(("float32", "float64")):
        itemsize = np.dtype(cc.np_dtype(dtype)).itemsize
        count = 5 * SIZE * direct_allreduce._CHUNK_BYTES // (2 * itemsize) + 11   # 2.5 per share
        specs = [(f"shs.chunks.{dtype}.{op}", dtype, op, (count,), 1.0, 1.0)
                 for op in ("Sum", "Average")]
        run_allreduces(specs, 200 + i, in_place=i % 2 == 0)
        expected += len(specs)
    for i, dtype in enumerate(("float32", "int32", "float16", "float64")):
        count = (2 << 20) // np.dtype(cc.np_dtype(dtype)).itemsize + 3
        specs = [(f"shs.scaled.{dtype}.{op}", dtype, op, (count,), 0.5, 3.0)
                 for op in ("Sum", "Average", "Max")]
        run_allreduces(specs, 100 + i, in_place=i % 2 == 0)
        expected += len(specs)
    assert (backend.direct is None) == (not cma_on), "HVDLITE_DIRECT_COPIES decided nothing"
    if not shm_on:
        assert backend.shared is None, "a window exists although HVDLITE_SHM_WINDOW_MB=0"
    if cma_on and not ONE_NODE:
        reason = backend.direct.unavailable_reason or ""
        assert "not all on one node" in reason, f"direct copies across hosts: {reason!r}"
    direct = cma_on and ONE_NODE and cc.direct_copies_expected(backend)
    want = [expected if direct else 0, expected if shm_on and ONE_NODE and not direct else 0]
    got = [0 if c is None else c.singles - b for c, b in zip(counters, before)]
    assert got == want, (f"single tensors by direct copies / through the window: {got}, "
                         f"expected {want}")


CASES = {
    "config_applied": config_applied,
    "steady.same_names_mixed": same_names_mixed,
    "steady.many_steps_cached": many_steps_cached,
    "steady.shape_change": shape_change,
    "steady.shape_change_one_rank_first_dim": shape_change_one_rank_first_dim,
    "steady.dtype_change": dtype_change,
    "steady.op_change": op_change,
    "steady.scale_change": scale_change,
    "steady.kind_change": kind_change,
    "steady.root_change": root_change,
    "steady.large_and_small": large_and_small,
    "steady.fused_scaled": fused_scaled,
    "steady.inplace_and_noncontiguous_fused": inplace_and_noncontiguous_fused,
    "steady.unnamed": unnamed,
    "steady.more_names_than_cache": more_names_than_cache,
    "steady.out_of_order_repeated": out_of_order_repeated,
    "steady.pooled_results": pooled_results,
    "steady.shared_fusion": shared_fusion,
    "steady.large_single": large_single,
}
assert list(CASES) == cc.STEADY_CASES
for name, fn in CASES.items():
    r.case(name, fn)
r.write()
hvd.shutdown()
