"""The GPU data path's host-staged backend (HVDLITE_GPU_OPERATIONS=mpi) under real MPI launches,
without a GPU: "device" arrays are numpy arrays handled by a loopback runtime (gpu_loopback.py).

Run under ``mpiexec`` at 2 and 3 ranks (tests/core/test_gpu_staged.py), which sets
HVDLITE_GPU_OPERATIONS=mpi.  The loopback is installed before ``hvd.init()``; every rank's
"GPU" is cuda:<rank> (different indices on different ranks, the normal one-GPU-per-rank layout),
and arrays are submitted through ``hvdlite.common.api.ops.submit(..., device=0)`` (the device
argument only says "on a GPU"; which one comes from the runtime).  bfloat16 travels as an int16
view with ``dtype="bfloat16"``, as the torch bridge hands it over.

Every result is checked against numpy references computed locally from every rank's input
(core_cases/core_refs: exact for integers and bool, and for floats where the inputs make it
exact), and the loopback's counters check that the data really went device -> host -> device
(one copy each way per tensor; one host synchronisation per executed batch, so fusion of device
entries is visible).  Within a case every collective is issued (wrapped in ``attempt``) before
anything is checked, so a failing check never leaves another rank waiting.

Importable without MPI: ``cases_for(size)`` lists the cases a job of ``size`` ranks reports.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # sibling helper modules

import numpy as np  # noqa: E402

import hvdlite as hvd  # noqa: E402
from tests.workers._report import CaseRegistry, pow2  # noqa: E402
from tests.workers import core_cases as cc  # noqa: E402
from tests.workers import gpu_loopback  # noqa: E402
from tests.workers.core_refs import (Expected, allreduce_expected, attempt,  # noqa: E402
                                     check_array, check_exact)
from hvdlite.common.runtime import state
from hvdlite.common.gpu import cuda
from hvdlite.common.api import grouped
from hvdlite.common.api import ops
from hvdlite.common.errors import (GpuUnavailableError, HvdliteError,  # noqa: E402
                                   TensorMismatchError)
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST,  # noqa: E402
                                     REDUCESCATTER, split_rows)
from hvdlite.common.reduce_ops import ReduceOp  # noqa: E402

RANK = SIZE = -1          # set by main() after hvd.init()
RT: "StagedLoopback" = None   # the installed loopback runtime
PSET = None               # process set of ranks 1..size-1 (registered at init)
OP = {name: getattr(ReduceOp, name) for name in cc.OPS}

# dtypes the device path is checked with (torch's set: no uint16/32/64)
DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "bool"]
NUMERIC = [d for d in DTYPES if d != "bool"]
SHAPES = ("scalar", "vec", "cube", "empty")

CASES = CaseRegistry()
register, case = CASES.register, CASES.case


# Cases that rely on the response cache run before ~1000 other names fill it (it never evicts).
EARLY = ["join.before_any_device_tensor",   # must be first: no device tensor used before it
         "config.gpu_operations_is_mpi", "cache.cpu_then_gpu_same_name",
         "fusion.one_round_many_small", "grouped.allreduce",
         "mismatch.device.allreduce.cpu_on_0.cached"]


def cases_for(size: int) -> list[str]:
    names = CASES.names_for(size)
    return [n for n in EARLY if n in names] + [n for n in names if n not in EARLY]


def assert_cache_has_room() -> None:
    """The premise of a cache case: the names it repeats can still be cached."""
    cache = state.engine().controller.cache
    assert len(cache) < cache.capacity - 64, (
        f"response cache nearly full ({len(cache)} of {cache.capacity}): this case would not "
        f"exercise it; run it earlier")


# --- the loopback runtime ------------------------------------------------------------------------
class StagedLoopback(gpu_loopback.LoopbackRuntime):
    """The loopback, plus: arrays listed in ``foreign`` report the next GPU (one-GPU-per-process
    check), ``hold`` parks the engine thread inside the next staging synchronisation until the
    main thread releases it (so tensors submitted meanwhile all reach one negotiation round), and
    the devices the backend was asked to work on are recorded."""

    def __init__(self) -> None:
        super().__init__(nccl=False)
        self.fail_to_host = False   # the next device-to-host copy raises (once)
        self.foreign: set[int] = set()
        self.hold: tuple[threading.Event, threading.Event] | None = None
        self.devices_used: set[int] = set()

    def device_of(self, array):
        return self.device_id + 1 if id(array) in self.foreign else self.device_id

    def to_host(self, array):
        if self.fail_to_host:
            self.fail_to_host = False
            raise RuntimeError("cudaErrorIllegalAddress (injected by the test)")
        return super().to_host(array)

    def synchronize(self, device_id):
        super().synchronize(device_id)
        self.devices_used.add(device_id)
        hold, self.hold = self.hold, None
        if hold is not None:
            entered, release = hold
            entered.set()
            release.wait(30.0)   # bounded: a broken test fails, it does not hang


def counters() -> tuple[int, int, int]:
    return RT.to_host_calls, RT.to_device_calls, RT.synchronize_calls


def since(before: tuple[int, int, int]) -> dict[str, int]:
    now = counters()
    return {"to_host": now[0] - before[0], "to_device": now[1] - before[1],
            "synchronize": now[2] - before[2]}


def expect_counts(label: str, got: dict[str, int], **want: int) -> None:
    bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    assert not bad, f"{label}: loopback counters (got, want) {bad}; all: {got}"


# --- device arrays --------------------------------------------------------------------------------
def to_device(x: np.ndarray, dtype: str) -> np.ndarray:
    """A fresh "device" array holding ``x``: bfloat16 as the int16 view the torch bridge uses."""
    x = np.array(x, copy=True)
    return x.view(np.int16) if dtype == "bfloat16" else x


def override(dtype: str) -> str | None:
    return "bfloat16" if dtype == "bfloat16" else None


def arith(got, dtype: str):
    """A device result as the arithmetic dtype (checks the device dtype was kept)."""
    if isinstance(got, BaseException):
        return got
    want = np.int16 if dtype == "bfloat16" else cc.np_dtype(dtype)
    assert isinstance(got, np.ndarray), f"result is {type(got).__name__}, not a device array"
    assert got.dtype == want, f"device result has dtype {got.dtype}, want {np.dtype(want)}"
    return got.view(cc.np_dtype("bfloat16")) if dtype == "bfloat16" else got


def garbage_like(x: np.ndarray) -> np.ndarray:
    """An output array that does not already hold the answer."""
    out = np.empty_like(x)
    if out.dtype == bool:
        out.fill(True)
    else:
        out.reshape(-1).view(np.uint8).fill(0x5A)
    return out


def dsubmit(kind: str, x, dtype: str | None = None, **kw):
    """Submit a device operation; the handle, or the exception submission raised."""
    return attempt(lambda: ops.submit(kind, x, device=0, dtype=dtype, **kw))


def finish(h):
    if isinstance(h, BaseException):
        return h
    return attempt(h.wait)


def joined_expected(inputs, active, dtype, op, pre=1.0, post=1.0) -> Expected:
    """An allreduce where only ``active`` ranks submit and the others have joined (their
    contribution is the identity; Average still divides by every rank)."""
    mine = [inputs[k] for k in active]
    if op == "Average":
        return allreduce_expected(mine, dtype, "Sum", SIZE, pre, post * (1.0 / SIZE))
    return allreduce_expected(mine, dtype, op, SIZE, pre, post)


def rows_of(exp: Expected, start: int, stop: int) -> Expected:
    if exp.exact is not None:
        return Expected(exp.dtype, exact=exp.exact[start:stop])
    return Expected(exp.dtype, ref64=exp.ref64[start:stop], tol=exp.tol[start:stop])


# --- join before this process ever used its GPU (must run first) ----------------------------------
def join_case(tag: str, joiner: int) -> None:
    """Rank ``joiner`` joins at once; the others allreduce device tensors (every op, several
    dtypes, fused, in place and out of place, scaled), so the joined rank contributes the
    identity through its own GPU path.  The last rank to join is made deterministic: it runs one
    more allreduce that can only finish once every other rank has joined."""
    others = [k for k in range(SIZE) if k != joiner]
    last = max(others)
    specs = [(op, dt, 1.0, 1.0) for op in cc.OPS for dt in ("int32", "float32", "bfloat16")]
    specs += [("Product", "float32", 2.0, 0.5), ("Sum", "int32", 2.5, 1.0),
              ("Min", "int16", 2.0, 1.0), ("Max", "bool", 1.0, 1.0)]
    inputs = {i: [cc.op_input(f"{tag}.{i}", k, dt, op, (5,)) for k in range(SIZE)]
              for i, (op, dt, _, _) in enumerate(specs)}
    if RANK == joiner:
        before = counters()
        got = attempt(hvd.join)
        moved = since(before)
        if isinstance(got, BaseException):
            raise AssertionError(f"join() raised {type(got).__name__}: {got}")
        assert got == last, f"join() returned {got!r}, want {last}"
        # the identity is made on the host and its result is never read: no device copies;
        # but it runs through this rank's GPU backend, as the others' device batches do (NCCL
        # needs every rank in the call)
        expect_counts("joined rank", moved, to_host=0, to_device=0)
        assert moved["synchronize"] >= 1, f"joined rank's identity skipped the GPU path: {moved}"
        assert RT.devices_used <= {RANK}, f"staged on {RT.devices_used}, this rank is cuda:{RANK}"
        return
    pending = []
    for i, (op, dt, pre, post) in enumerate(specs):
        x = to_device(inputs[i][RANK], dt)
        in_place = i % 2 == 1
        h = dsubmit(ALLREDUCE, x, override(dt), output=x if in_place else None,
                    reduce_op=OP[op], prescale_factor=pre, postscale_factor=post,
                    name=f"{tag}.{i}")
        pending.append((f"#{i} {op} {dt} pre={pre} post={post}"
                        f"{' in place' if in_place else ''}", h, x, in_place, dt,
                        joined_expected(inputs[i], others, dt, op, pre, post)))
    results = [(label, finish(h), x, in_place, dt, exp)
               for label, h, x, in_place, dt, exp in pending]
    extra_in = [np.arange(4, dtype=np.float64) + 10 * k for k in range(SIZE)]
    extra = None
    if RANK == last:
        extra = finish(dsubmit(ALLREDUCE, to_device(extra_in[RANK], "float64"),
                               reduce_op=ReduceOp.Sum, name=f"{tag}.extra"))
    got = attempt(hvd.join)
    for label, res, x, in_place, dt, exp in results:
        if in_place and not isinstance(res, BaseException):
            assert res is x, f"{label}: in-place result is not the input array"
        check_array(label, arith(res, dt), exp)
    if RANK == last:
        check_array("last joiner's allreduce", extra, Expected("float64", exact=extra_in[last]))
    if isinstance(got, BaseException):
        raise AssertionError(f"join() raised {type(got).__name__}: {got}")
    assert got == last, f"join() returned {got!r}, want {last}"


register("join.before_any_device_tensor",
         lambda: join_case("jfresh", SIZE - 1))


@case("config.gpu_operations_is_mpi")
def config_is_mpi():
    assert state.engine().config.gpu_operations == "mpi", state.engine().config
    assert cuda.runtime() is RT, cuda.runtime()


# --- allreduce ------------------------------------------------------------------------------------
def allreduce_case(name: str, op: str, dtype: str) -> None:
    """Every shape; a new output, a given output and in place; all in flight together."""
    before = counters()
    pending = []
    for sk in SHAPES:
        inputs = [cc.op_input(f"{name}.{sk}", k, dtype, op, cc.SHAPES[sk]) for k in range(SIZE)]
        exp = allreduce_expected(inputs, dtype, op, SIZE)
        for variant in ("new", "given", "inplace"):
            x = to_device(inputs[RANK], dtype)
            kept = x.copy()
            out = {"new": None, "given": garbage_like(x), "inplace": x}[variant]
            h = dsubmit(ALLREDUCE, x, override(dtype), output=out, reduce_op=OP[op],
                        name=f"{name}.{sk}.{variant}")
            pending.append((f"{sk} {variant}", variant, x, kept, out, h, exp))
    results = [(label, variant, x, kept, out, finish(h), exp)
               for label, variant, x, kept, out, h, exp in pending]
    moved = since(before)
    for label, variant, x, kept, out, got, exp in results:
        if not isinstance(got, BaseException):
            if variant == "new":
                assert got is not x, f"{label}: out-of-place result is the input array"
            else:
                assert got is out, f"{label}: result is not the output array that was passed"
        check_array(label, arith(got, dtype), exp)
        if variant != "inplace":
            assert np.array_equal(x, kept), f"{label}: out-of-place allreduce changed its input"
    n = len(results)
    expect_counts("staging", moved, to_host=n, to_device=n)


for _op in cc.OPS:
    for _dt in DTYPES:
        if not (_dt == "bool" and _op == "Average"):
            _name = f"allreduce.{_op}.{_dt}"
            register(_name, functools.partial(allreduce_case, _name, _op, _dt))


def scaled_input(case_name: str, rank: int, dtype: str, op: str, shape: tuple) -> np.ndarray:
    if dtype in cc.FLOAT_DTYPES:
        return cc.op_input(case_name, rank, dtype, op, shape)
    rng = cc.rng_for(case_name, rank)
    dt = cc.np_dtype(dtype)
    hi = 2 if op == "Product" else 7
    lo = -hi if dt.kind == "i" else 0
    return rng.integers(lo, hi + 1, size=shape).astype(dt)


def scaled_case(name: str, op: str, dtype: str) -> None:
    """prescale/postscale factors, out of place and in place (integers truncate toward zero)."""
    inputs = [scaled_input(name, k, dtype, op, (6,)) for k in range(SIZE)]
    pending = []
    for i, (pre, post) in enumerate(cc.SCALE_FACTORS):
        for in_place in (False, True):
            x = to_device(inputs[RANK], dtype)
            kept = x.copy()
            h = dsubmit(ALLREDUCE, x, override(dtype), output=x if in_place else None,
                        reduce_op=OP[op], prescale_factor=pre, postscale_factor=post,
                        name=f"{name}.{i}.{in_place}")
            pending.append((pre, post, in_place, x, kept, h))
    for pre, post, in_place, x, kept, h in pending:
        got = finish(h)
        label = f"pre={pre} post={post} {'in place' if in_place else 'out of place'}"
        check_array(label, arith(got, dtype),
                    allreduce_expected(inputs, dtype, op, SIZE, pre, post))
        if not in_place:
            assert np.array_equal(x, kept), f"{label}: out-of-place allreduce changed its input"


for _op in cc.OPS:
    for _dt in NUMERIC:
        _name = f"allreduce_scaled.{_op}.{_dt}"
        register(_name, functools.partial(scaled_case, _name, _op, _dt))


@case("fusion.one_round_many_small")
def fusion_one_round():
    """Many small device allreduces (three fusion keys, interleaved) plus CPU allreduces reach one
    negotiation round on every rank: the engine thread is parked inside a gate operation's
    staging while they are submitted.  Each fusion key must run as one staged batch (one host
    synchronisation), every device tensor is copied to the host and back exactly once, and the
    CPU tensors (same dtype/op as one key) are neither fused with device tensors nor staged.
    Run twice: names negotiated in full, then through the response cache."""
    assert_cache_has_room()
    n = 24
    for step in range(2):
        gate_in = [np.full(3, k + 1, np.int64) for k in range(SIZE)]
        specs, inputs = [], []
        for i in range(n):
            key = i % 3
            if key == 0:
                spec = ("float32", "Sum", 1.0, 1.0, False, (i + 1,))
            elif key == 1:
                spec = ("int32", "Average", 1.0, 1.0, True, (2, i % 4 + 1))
            else:
                spec = ("bfloat16", "Sum", 0.5, 4.0, False, (3,))
            specs.append(spec)
            dt, op, _, _, _, shape = spec
            inputs.append([cc.op_input(f"fusion.{step}.{i}", k, dt, op, shape)
                           for k in range(SIZE)])
        cpu_in = [[cc.op_input(f"fusion.cpu.{step}.{j}", k, "float32", "Sum", (4,))
                   for k in range(SIZE)] for j in range(4)]
        entered, release = threading.Event(), threading.Event()
        RT.hold = (entered, release)
        before = counters()
        try:
            gate = dsubmit(ALLREDUCE, gate_in[RANK].copy(), reduce_op=ReduceOp.Sum,
                           name="fusion.gate")
            parked = entered.wait(30.0)
            handles = []
            for i, (dt, op, pre, post, in_place, _) in enumerate(specs):
                x = to_device(inputs[i][RANK], dt)
                handles.append((x, in_place, dsubmit(
                    ALLREDUCE, x, override(dt), output=x if in_place else None,
                    reduce_op=OP[op], prescale_factor=pre, postscale_factor=post,
                    name=f"fusion.{i}")))
            cpu = [attempt(lambda j=j: hvd.allreduce_async(cpu_in[j][RANK], op=hvd.Sum,
                                                           name=f"fusion.cpu.{j}"))
                   for j in range(4)]
        finally:
            release.set()
            RT.hold = None
        gate_out = finish(gate)
        results = [(x, in_place, finish(h)) for x, in_place, h in handles]
        cpu_out = [finish(h) for h in cpu]
        moved = since(before)
        assert parked, "the gate operation never reached staging (engine thread not parked)"
        check_array(f"step {step} gate", gate_out, allreduce_expected(gate_in, "int64", "Sum",
                                                                      SIZE))
        for i, ((dt, op, pre, post, in_place, _), (x, _, got)) in enumerate(zip(specs, results)):
            if in_place and not isinstance(got, BaseException):
                assert got is x, f"step {step} #{i}: in-place result is not the input"
            check_array(f"step {step} #{i} {dt} {op}", arith(got, dt),
                        allreduce_expected(inputs[i], dt, op, SIZE, pre, post))
        for j, got in enumerate(cpu_out):
            check_array(f"step {step} cpu #{j}", got,
                        allreduce_expected(cpu_in[j], "float32", "Sum", SIZE))
        # gate + 24 device tensors staged once each; gate + one batch per fusion key
        expect_counts(f"step {step}", moved, to_host=1 + n, to_device=1 + n, synchronize=1 + 3)


@case("adasum.matches_cpu_path", when=pow2)
def adasum_matches_cpu():
    """Adasum (host-staged on every GPU backend) gives the CPU path's bits."""
    pending = []
    for dt in ("float32", "float64", "bfloat16", "float16"):
        xs = [cc.op_input("adasum", k, dt, "Sum", (9,)) for k in range(SIZE)]
        cpu = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Adasum, name=f"adasum.cpu.{dt}"))
        dev = finish(dsubmit(ALLREDUCE, to_device(xs[RANK], dt), override(dt),
                             reduce_op=ReduceOp.Adasum, name=f"adasum.gpu.{dt}"))
        pending.append((dt, cpu, dev))
    for dt, cpu, dev in pending:
        if isinstance(cpu, BaseException):
            raise AssertionError(f"{dt}: CPU Adasum raised {cpu!r}")
        check_exact(f"{dt} device Adasum vs CPU Adasum", arith(dev, dt), cpu)


# --- allgather ------------------------------------------------------------------------------------
def gather_input(name: str, rank: int, dtype: str, shape_key: str) -> np.ndarray:
    row = cc.GATHER_SHAPES[shape_key]
    if row is None:   # a 0-d input counts as one row
        return cc.op_input(name, rank, dtype, "Sum", ())
    return cc.op_input(name, rank, dtype, "Sum", (cc.gather_rows(rank, SIZE, shape_key),) + row)


def allgather_case(name: str, dtype: str) -> None:
    """Different first dimensions per rank (rank 1 contributes none), every row shape."""
    before = counters()
    pending = []
    for sk in cc.GATHER_SHAPES:
        inputs = [gather_input(f"{name}.{sk}", k, dtype, sk) for k in range(SIZE)]
        want = np.concatenate([np.reshape(v, (1,) if v.ndim == 0 else v.shape) for v in inputs])
        x = to_device(inputs[RANK], dtype)
        kept = x.copy()
        pending.append((sk, x, kept, want, dsubmit(ALLGATHER, x, override(dtype),
                                                   name=f"{name}.{sk}")))
    results = [(sk, x, kept, want, finish(h)) for sk, x, kept, want, h in pending]
    moved = since(before)
    for sk, x, kept, want, got in results:
        check_exact(sk, arith(got, dtype), want)
        assert np.array_equal(x, kept), f"{sk}: allgather changed its input"
    expect_counts("staging", moved, to_host=len(results), to_device=len(results))


for _dt in DTYPES:
    _name = f"allgather.{_dt}"
    register(_name, functools.partial(allgather_case, _name, _dt))


# --- broadcast ------------------------------------------------------------------------------------
def broadcast_case(name: str, dtype: str, root: int) -> None:
    before = counters()
    pending = []
    for sk in SHAPES:
        inputs = [cc.op_input(f"{name}.{sk}", k, dtype, "Sum", cc.SHAPES[sk])
                  for k in range(SIZE)]
        for variant in ("new", "given", "inplace"):
            x = to_device(inputs[RANK], dtype)
            kept = x.copy()
            out = {"new": None, "given": garbage_like(x), "inplace": x}[variant]
            h = dsubmit(BROADCAST, x, override(dtype), output=out, root_rank=root,
                        name=f"{name}.{sk}.{variant}")
            pending.append((f"{sk} {variant}", variant, x, kept, out, inputs[root], h))
    results = [(label, variant, x, kept, out, want, finish(h))
               for label, variant, x, kept, out, want, h in pending]
    moved = since(before)
    for label, variant, x, kept, out, want, got in results:
        if not isinstance(got, BaseException) and variant != "new":
            assert got is out, f"{label}: result is not the output array that was passed"
        check_exact(label, arith(got, dtype), want)
        if variant != "inplace":
            assert np.array_equal(x, kept), f"{label}: out-of-place broadcast changed its input"
        else:
            check_exact(f"{label} (the array itself)", arith(x, dtype), want)
    expect_counts("staging", moved, to_host=len(results), to_device=len(results))


for _dt in DTYPES:
    for _root in range(3):
        _name = f"broadcast.{_dt}.root{_root}"
        register(_name, functools.partial(broadcast_case, _name, _dt, _root),
                 when=lambda size, r=_root: r < size)


# --- alltoall -------------------------------------------------------------------------------------
def a2a_splits(rank: int) -> list[int]:
    """Uneven, with zeros: rank r sends (r + 2j) % 3 rows to rank j."""
    return [(rank + 2 * j) % 3 for j in range(SIZE)]


def alltoall_case(name: str, dtype: str) -> None:
    before = counters()
    pending = []
    for row in ((), (2,), (2, 2)):
        inputs = [cc.op_input(f"{name}.{len(row)}", k, dtype, "Sum", (sum(a2a_splits(k)),) + row)
                  for k in range(SIZE)]
        parts, got_splits = [], []
        for k in range(SIZE):
            s = a2a_splits(k)
            off = sum(s[:RANK])
            parts.append(inputs[k][off:off + s[RANK]])
            got_splits.append(s[RANK])
        want = (np.concatenate(parts), got_splits)
        x = to_device(inputs[RANK], dtype)
        pending.append((f"rows {row} splits {a2a_splits(RANK)}", x, x.copy(), want,
                        dsubmit(ALLTOALL, x, override(dtype), splits=a2a_splits(RANK),
                                name=f"{name}.{len(row)}")))
    even = [cc.op_input(f"{name}.even", k, dtype, "Sum", (2 * SIZE, 3)) for k in range(SIZE)]
    x = to_device(even[RANK], dtype)
    pending.append(("even split", x, x.copy(),
                    (np.concatenate([v[2 * RANK:2 * RANK + 2] for v in even]), [2] * SIZE),
                    dsubmit(ALLTOALL, x, override(dtype), name=f"{name}.even")))
    results = [(label, x, kept, want, finish(h)) for label, x, kept, want, h in pending]
    moved = since(before)
    for label, x, kept, (want, want_splits), got in results:
        if isinstance(got, BaseException):
            raise AssertionError(f"{label}: raised {type(got).__name__}: {got}")
        assert isinstance(got, tuple) and len(got) == 2, f"{label}: result {got!r}"
        rows, splits = got
        check_exact(label, arith(rows, dtype), want)
        assert [int(v) for v in np.asarray(splits)] == want_splits, (
            f"{label}: received splits {splits!r}, want {want_splits}")
        assert np.array_equal(x, kept), f"{label}: alltoall changed its input"
    expect_counts("staging", moved, to_host=len(results), to_device=len(results))


for _dt in DTYPES:
    _name = f"alltoall.{_dt}"
    register(_name, functools.partial(alltoall_case, _name, _dt))


# --- reducescatter --------------------------------------------------------------------------------
def reducescatter_case(name: str, op: str, dtype: str) -> None:
    """7 rows (uneven split) and fewer rows than ranks (some ranks get none), plain and
    scaled."""
    pending = []
    for nrows in (7, SIZE - 1):
        rows = split_rows(nrows, SIZE)
        start = sum(rows[:RANK])
        for pre, post in ((1.0, 1.0), (2.5, 0.25)):
            tag = f"{name}.{nrows}.{pre}"
            inputs = [scaled_input(tag, k, dtype, op, (nrows, 3)) for k in range(SIZE)]
            exp = allreduce_expected(inputs, dtype, op, SIZE, pre, post)
            x = to_device(inputs[RANK], dtype)
            pending.append((f"{nrows} rows pre={pre} post={post}", x, x.copy(),
                            rows_of(exp, start, start + rows[RANK]),
                            dsubmit(REDUCESCATTER, x, override(dtype), reduce_op=OP[op],
                                    prescale_factor=pre, postscale_factor=post, name=tag)))
    for label, x, kept, exp, h in pending:
        check_array(label, arith(finish(h), dtype), exp)
        assert np.array_equal(x, kept), f"{label}: reducescatter changed its input"


for _op in cc.OPS:
    for _dt in NUMERIC:
        _name = f"reducescatter.{_op}.{_dt}"
        register(_name, functools.partial(reducescatter_case, _name, _op, _dt))


# --- grouped --------------------------------------------------------------------------------------
GROUP_SPECS = [("float32", (3,)), ("int32", (2, 2)), ("float64", ()), ("bfloat16", (4,)),
               ("float32", (5,)), ("int32", (0,))]


@case("grouped.allreduce")
def grouped_allreduce():
    """hvdlite.common.api.grouped.submit_group with device=0: the members are released together, so
    each dtype runs as one staged batch (one host synchronisation per dtype); in place and out of
    place, Sum and Average, twice under the same name (full negotiation, then the cache)."""
    assert_cache_has_room()
    n_dtypes = len({d for d, _ in GROUP_SPECS})
    pending = []
    for step in range(2):
        for op in ("Sum", "Average"):
            for in_place in (False, True):
                inputs = [[cc.op_input(f"grp.{step}.{op}.{in_place}.{i}", k, d, op, s)
                           for k in range(SIZE)] for i, (d, s) in enumerate(GROUP_SPECS)]
                xs = [to_device(m[RANK], d) for m, (d, _) in zip(inputs, GROUP_SPECS)]
                kept = [x.copy() for x in xs]
                before = counters()
                h = attempt(lambda: grouped.submit_group(
                    ALLREDUCE, xs, name=f"grp.{op}.{in_place}", outputs=xs if in_place else None,
                    dtypes=[override(d) for d, _ in GROUP_SPECS], device=0, reduce_op=OP[op]))
                got = finish(h)
                pending.append((f"step {step} {op} {'in place' if in_place else 'new'}",
                                in_place, xs, kept, got, since(before),
                                [allreduce_expected(m, d, op, SIZE)
                                 for m, (d, _) in zip(inputs, GROUP_SPECS)]))
    for label, in_place, xs, kept, got, moved, exps in pending:
        if isinstance(got, BaseException):
            raise AssertionError(f"{label}: raised {type(got).__name__}: {got}")
        assert len(got) == len(GROUP_SPECS), f"{label}: {len(got)} results"
        for i, (g, exp, x, k) in enumerate(zip(got, exps, xs, kept)):
            if in_place:
                assert g is x, f"{label} member {i}: in-place result is not the input"
            else:
                assert np.array_equal(x, k), f"{label} member {i}: input changed"
            check_array(f"{label} member {i}", arith(g, GROUP_SPECS[i][0]), exp)
        expect_counts(label, moved, to_host=len(GROUP_SPECS), to_device=len(GROUP_SPECS),
                      synchronize=n_dtypes)


@case("grouped.allgather")
def grouped_allgather():
    specs = [("int16", (2,)), ("bfloat16", ()), ("float32", (3, 2))]
    inputs = [[cc.op_input(f"grpag.{i}", k, d, "Sum", (cc.gather_rows(k, SIZE, "vec"),) + s)
               for k in range(SIZE)] for i, (d, s) in enumerate(specs)]
    xs = [to_device(m[RANK], d) for m, (d, _) in zip(inputs, specs)]
    got = finish(attempt(lambda: grouped.submit_group(
        ALLGATHER, xs, name="grpag", dtypes=[override(d) for d, _ in specs], device=0)))
    if isinstance(got, BaseException):
        raise AssertionError(f"raised {type(got).__name__}: {got}")
    for i, (g, m, (d, _)) in enumerate(zip(got, inputs, specs)):
        check_exact(f"member {i}", arith(g, d), np.concatenate(m))


# --- joins ----------------------------------------------------------------------------------------
for _k in range(3):
    register(f"join.rank{_k}_joins", functools.partial(join_case, f"join{_k}", _k),
             when=lambda size, k=_k: k < size)


# --- CPU against GPU under one name ---------------------------------------------------------------
def mismatch_case(tag: str, kind: str, odd: int) -> None:
    """Rank ``odd`` submits a CPU tensor, the others a GPU one: every rank gets a
    TensorMismatchError naming the tensor, both kinds of device and the ranks; the same name
    then works on the GPU everywhere."""
    xs = [np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * k for k in range(SIZE)]
    name = f"{tag}.t"
    kw = {"reduce_op": ReduceOp.Sum} if kind == ALLREDUCE else (
        {"root_rank": 0} if kind == BROADCAST else {})
    if tag.endswith("cached"):   # the name is in the response cache when the mismatch comes
        assert_cache_has_room()
        warm = [finish(dsubmit(kind, xs[RANK].copy(), name=name, **kw)) for _ in range(2)]
    else:
        warm = []
    device = -1 if RANK == odd else 0
    bad = finish(attempt(lambda: ops.submit(kind, xs[RANK].copy(), name=name, device=device,
                                            **kw)))
    after = finish(dsubmit(kind, xs[RANK].copy(), name=name, **kw))
    cpu_after = finish(attempt(lambda: ops.submit(kind, xs[RANK].copy(), name=name + ".cpu",
                                                  **kw)))
    for i, w in enumerate(warm):
        assert not isinstance(w, BaseException), f"warm-up #{i} raised {w!r}"
    if not isinstance(bad, TensorMismatchError):
        raise AssertionError(f"expected TensorMismatchError, got {bad!r}")
    msg = str(bad)
    gpu_ranks = [k for k in range(SIZE) if k != odd]
    for part in (name, "device", "'cpu'", "'gpu'", f"ranks {[odd]}", f"ranks {gpu_ranks}"):
        assert part in msg, f"{part!r} missing from: {msg}"
    want = {ALLREDUCE: sum(xs), BROADCAST: xs[0], ALLGATHER: np.concatenate(xs)}[kind]
    check_exact("the same name on the GPU afterwards", after, want)
    check_exact("a CPU op afterwards", cpu_after, want)


for _kind, _odd, _tag in ((ALLREDUCE, 0, "fresh"), (ALLREDUCE, -1, "fresh"),
                          (ALLREDUCE, 0, "cached"), (ALLGATHER, 1, "fresh"),
                          (BROADCAST, -1, "fresh")):
    register(f"mismatch.device.{_kind}.cpu_on_{'last' if _odd < 0 else _odd}.{_tag}",
             lambda kind=_kind, odd=_odd, tag=_tag: mismatch_case(
                 f"mm.{kind}.{odd}.{tag}", kind, odd % SIZE))


# --- one GPU per process --------------------------------------------------------------------------
@case("one_gpu_per_process")
def one_gpu_per_process():
    """A tensor on another GPU than the one this process uses fails at submission, on its own
    rank, before anything is in flight; the same name then works with a tensor on the right
    GPU."""
    xs = [np.full(4, k + 1, np.float32) for k in range(SIZE)]
    other = xs[RANK].copy()
    RT.foreign.add(id(other))
    before = counters()
    try:
        bad = attempt(lambda: ops.submit(ALLREDUCE, other, device=0, reduce_op=ReduceOp.Sum,
                                         name="onegpu"))
    finally:
        RT.foreign.discard(id(other))
    moved = since(before)
    good = finish(dsubmit(ALLREDUCE, xs[RANK].copy(), reduce_op=ReduceOp.Sum, name="onegpu"))
    if not isinstance(bad, GpuUnavailableError):
        if not isinstance(bad, BaseException):
            bad.wait(30)   # it went in flight: let it finish (the other ranks submitted it too)
        raise AssertionError(f"expected GpuUnavailableError at submission, got {bad!r}")
    msg = str(bad)
    for part in (f"cuda:{RANK + 1}", f"cuda:{RANK}", "one GPU per process", "'onegpu'"):
        assert part in msg, f"{part!r} missing from: {msg}"
    expect_counts("failed submission", moved, to_host=0, to_device=0, synchronize=0)
    check_exact("the same name afterwards", good, sum(xs))
    assert RT.devices_used == {RANK}, f"staged on {RT.devices_used}, this rank is cuda:{RANK}"


# --- a device failure on one rank only ----------------------------------------------------------
@case("device_failure_on_one_rank")
def device_failure_on_one_rank():
    """Rank 0's device copy fails after negotiation: every rank must get an error naming rank 0
    (nobody is left waiting inside the collective), and the next operations work."""
    RT.fail_to_host = RANK == 0
    bad = finish(dsubmit(ALLREDUCE, np.full(3, 1.0, np.float32), reduce_op=ReduceOp.Sum,
                         name="fail.one"))
    RT.fail_to_host = False
    good = finish(dsubmit(ALLREDUCE, np.full(3, RANK + 1.0, np.float32), reduce_op=ReduceOp.Sum,
                          name="fail.after"))
    cpu = attempt(lambda: hvd.allreduce(np.full(2, RANK + 1.0), op=hvd.Sum, name="fail.cpu"))
    assert isinstance(bad, HvdliteError), f"expected HvdliteError on every rank, got {bad!r}"
    msg = str(bad)
    assert "[0]" in msg and "before its collective" in msg, msg
    if RANK == 0:
        assert "cudaErrorIllegalAddress" in msg, msg
    check_exact("a device op afterwards", good, np.full(3, SIZE * (SIZE + 1) / 2, np.float32))
    check_exact("a CPU op afterwards", cpu, np.full(2, SIZE * (SIZE + 1) / 2))


# --- process sets ---------------------------------------------------------------------------------
@case("process_set.device_ops")
def process_set_ops():
    """Ranks 1..size-1 in their own process set (registered at init: its own engine and staged
    backend; the broadcast root is a global rank, the set's last), after a device allreduce by
    every rank in the global set.  With 2 ranks the set is rank 1 alone (the single-rank path,
    prescale included)."""
    members = list(range(1, SIZE))
    root = SIZE - 1
    xs = [cc.op_input("pset", k, "int32", "Sum", (5,)) for k in range(SIZE)]
    bs = [cc.op_input("pset.b", k, "bfloat16", "Sum", (3,)) for k in range(SIZE)]
    ws = [np.full(2, k, np.float64) for k in range(SIZE)]
    glob = finish(dsubmit(ALLREDUCE, to_device(ws[RANK], "float64"), reduce_op=ReduceOp.Sum,
                          name="pset.global"))
    if RANK == 0:
        check_exact("global allreduce", glob, sum(ws))
        return
    s = finish(dsubmit(ALLREDUCE, to_device(xs[RANK], "int32"), reduce_op=ReduceOp.Sum,
                       prescale_factor=2.0, name="pset.sum", process_set=PSET))
    b = to_device(bs[RANK], "bfloat16")
    bc = finish(dsubmit(BROADCAST, b, "bfloat16", output=b, root_rank=root, name="pset.bc",
                        process_set=PSET))
    g = finish(dsubmit(ALLGATHER, to_device(xs[RANK], "int32"), name="pset.ag",
                       process_set=PSET))
    check_exact("global allreduce", glob, sum(ws))
    check_array("set allreduce", s,
                allreduce_expected([xs[k] for k in members], "int32", "Sum", len(members), 2.0))
    check_exact("set broadcast (in place)", arith(bc, "bfloat16"), bs[root])
    check_exact("set allgather", g, np.concatenate([xs[k] for k in members]))


@case("allocate.custom_allocator")
def custom_allocator():
    """Outputs shaped after negotiation through the caller's allocator (what the torch adapter
    passes): called with the arithmetic dtype, its array (here the 16-bit device view for
    bfloat16, as torch's) is the result."""
    calls = []

    def allocator(device_dtype):
        def allocate(shape, np_dtype):
            out = np.empty(shape, device_dtype)
            calls.append((shape, np.dtype(np_dtype).name, out))
            return out
        return allocate
    xs = [cc.op_input("alloc", k, "bfloat16", "Sum", (2 * SIZE, 2)) for k in range(SIZE)]
    x = to_device(xs[RANK], "bfloat16")
    hs = {kind: attempt(lambda kind=kind: ops.submit(
        kind, x, name=f"alloc.{kind}", device=0, dtype="bfloat16",
        allocate=allocator(np.int16), reduce_op=ReduceOp.Sum))
        for kind in (ALLGATHER, ALLTOALL, REDUCESCATTER)}
    got = {kind: finish(h) for kind, h in hs.items()}
    assert sorted(c[0] for c in calls) == sorted([(2 * SIZE * SIZE, 2), (2 * SIZE, 2), (2, 2)]), (
        [c[:2] for c in calls])
    assert {c[1] for c in calls} == {"bfloat16"}, [c[:2] for c in calls]
    made = [c[2] for c in calls]
    gathered, (received, _), scattered = (got[ALLGATHER], got[ALLTOALL],
                                          got[REDUCESCATTER])
    for label, res in (("allgather", gathered), ("alltoall", received),
                       ("reducescatter", scattered)):
        assert any(res is m for m in made), f"{label}: result is not the allocator's array"
    check_exact("allgather", arith(gathered, "bfloat16"), np.concatenate(xs))
    check_exact("alltoall", arith(received, "bfloat16"),
                np.concatenate([v[2 * RANK:2 * RANK + 2] for v in xs]))
    check_array("reducescatter", arith(scattered, "bfloat16"),
                rows_of(allreduce_expected(xs, "bfloat16", "Sum", SIZE), 2 * RANK, 2 * RANK + 2))


@case("allreduce.large_not_fused")
def large_not_fused():
    """Tensors over the fusion cut-off (1 MiB) are reduced on their own: in place, out of
    place, scaled."""
    n = (1 << 20) // 4 + 7
    xs = [((np.arange(n) * (k + 3)) % 61 - 30).astype(np.float32) for k in range(SIZE)]
    before = counters()
    y = xs[RANK].copy()
    h_new = dsubmit(ALLREDUCE, xs[RANK].copy(), reduce_op=ReduceOp.Sum, prescale_factor=0.5,
                    postscale_factor=4.0, name="large.new")
    h_in = dsubmit(ALLREDUCE, y, output=y, reduce_op=ReduceOp.Average, name="large.inplace")
    new, inplace = finish(h_new), finish(h_in)
    moved = since(before)
    check_exact("out of place", new, (sum(xs) * 2).astype(np.float32))
    assert inplace is y, f"in-place result is {type(inplace).__name__}"
    check_array("in place", y, allreduce_expected(xs, "float32", "Average", SIZE))
    expect_counts("large", moved, to_host=2, to_device=2)


@case("cache.cpu_then_gpu_same_name")
def cpu_then_gpu_same_name():
    """One name, used on the CPU (cached), then on the GPU, then on the CPU again: the cached
    CPU response must not run the GPU tensors on the CPU path (and vice versa)."""
    assert_cache_has_room()
    xs = [np.full(3, k + 1, np.int64) for k in range(SIZE)]
    want = sum(xs)
    for phase, on_gpu in (("cpu", False), ("gpu", True), ("cpu again", False)):
        for step in range(2):
            before = counters()
            got = finish(attempt(lambda: ops.submit(ALLREDUCE, xs[RANK].copy(), name="cache.x",
                                                    device=0 if on_gpu else -1,
                                                    reduce_op=ReduceOp.Sum)))
            moved = since(before)
            check_exact(f"{phase} step {step}", got, want)
            n = 1 if on_gpu else 0
            expect_counts(f"{phase} step {step}", moved, to_host=n, to_device=n, synchronize=n)


@case("devices.staged_on_own_gpu")
def staged_on_own_gpu():
    assert RT.devices_used == {RANK}, f"staged on {RT.devices_used}, this rank is cuda:{RANK}"


# --- completion: asynchronous (the default), or after the host saw the device finish -------------
def async_completion() -> bool:
    return state.engine().config.gpu_async_completion


def wait_for(ready, what: str, seconds: float = 30.0) -> None:
    """Poll until ``ready()`` (bounded: a broken library fails the case, it does not hang)."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}"
        time.sleep(0.001)


@case("completion.mode_from_environment")
def completion_mode():
    raw = os.environ.get("HVDLITE_ENABLE_ASYNC_COMPLETION", "1")
    assert async_completion() is (raw != "0"), (raw, state.engine().config)


@case("completion.handle_versus_device_event")
def completion_handle_versus_event():
    """With the batch's event held back (its device work "still running"): under asynchronous
    completion the handle completes anyway, and wait() hands the result over by a device-side
    wait on the framework's stream (the registered provider's, for this rank's GPU), once; with
    HVDLITE_ENABLE_ASYNC_COMPLETION=0 the handle stays pending until the event fires."""
    cuda.set_consumer_stream(lambda device: 7000 + device)
    RT.stream_waits.clear()
    RT.hold_events = True
    h = None
    try:
        h = dsubmit(ALLREDUCE, np.full(4, RANK + 1.0, np.float32), reduce_op=ReduceOp.Sum,
                    name="completion.held")
        assert not isinstance(h, BaseException), repr(h)
        wait_for(lambda: RT.held, "the batch's event to be recorded")
        event = RT.held[0]
        if async_completion():
            wait_for(h.poll, "the handle to complete while its event is held")
            assert not event.fired.is_set()
            got = h.wait()
            assert RT.stream_waits == [(7000 + RT.device_id, False)], RT.stream_waits
            assert h.wait() is got and len(RT.stream_waits) == 1, "handed over twice"
        else:
            time.sleep(0.2)   # room for a wrong early completion to show
            assert not h.poll(), "handle completed before its device work finished"
            RT.release_events()
            got = h.wait(30)
            assert RT.stream_waits == [], RT.stream_waits
    finally:
        RT.hold_events = False
        RT.release_events()
        cuda.set_consumer_stream(None)
    check_exact("allreduce", got, np.full(4, SIZE * (SIZE + 1) / 2, np.float32))


@case("completion.without_a_framework_stream")
def completion_without_framework():
    """No framework registered its stream (the core API used directly): under asynchronous
    completion wait() waits for the event on the host, in the waiting thread."""
    cuda.set_consumer_stream(None)
    RT.host_waits.clear()
    RT.stream_waits.clear()
    got = finish(dsubmit(ALLREDUCE, np.full(2, RANK + 1.0), reduce_op=ReduceOp.Sum,
                         name="completion.host"))
    check_exact("allreduce", got, np.full(2, SIZE * (SIZE + 1) / 2))
    mine = RT.host_waits.count(threading.current_thread().name)
    assert mine == (1 if async_completion() else 0), RT.host_waits
    assert RT.stream_waits == [], RT.stream_waits


# --- last: shutdown with device work in flight, then init again on another GPU --------------------
@case("shutdown_with_device_work_then_reinit")
def shutdown_then_reinit():
    """A device allreduce still pending at shutdown() ends (its result, or a shutdown error)
    instead of hanging; after init() again the process may use another GPU (the claim was
    reset) and device operations work."""
    from hvdlite.common.errors import HvdliteError
    xs = [np.full(3, k + 1.0) for k in range(SIZE)]
    h = dsubmit(ALLREDUCE, xs[RANK].copy(), reduce_op=ReduceOp.Sum, name="reinit.pending")
    hvd.shutdown()
    pending = h if isinstance(h, BaseException) else attempt(lambda: h.wait(30))
    RT.device_id = RANK + SIZE
    RT.devices_used.clear()
    hvd.init()
    again = finish(dsubmit(ALLREDUCE, xs[RANK].copy(), reduce_op=ReduceOp.Sum,
                           name="reinit.pending"))
    if isinstance(pending, BaseException):
        assert isinstance(pending, HvdliteError), f"pending op at shutdown: {pending!r}"
    else:
        check_exact("pending op at shutdown", pending, sum(xs))
    check_exact("after init again", again, sum(xs))
    assert RT.devices_used == {RANK + SIZE}, f"staged on {RT.devices_used}"


# -----------------------------------------------------------------------------------------------
def main() -> None:
    global RANK, SIZE, RT, PSET
    from mpi4py import MPI
    from tests.workers._report import Reporter
    RT = StagedLoopback()
    cuda.set_runtime_for_tests(RT)   # before init: the engine must only ever see the loopback
    world = MPI.COMM_WORLD.Get_size()
    PSET = hvd.ProcessSet(list(range(1, world)))
    hvd.init(process_sets=[PSET])
    RANK, SIZE = hvd.rank(), hvd.size()
    RT.device_id = RANK   # one GPU per rank: cuda:<rank>
    r = Reporter(RANK)
    for name in cases_for(SIZE):
        r.case(name, CASES.function(name))
        r.write()   # a job killed on timeout still shows which case hung
    hvd.shutdown()


if __name__ == "__main__":
    main()
