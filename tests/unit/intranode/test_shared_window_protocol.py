"""The shared-memory window's multi-rank protocol (hvdlite/common/intranode/shared_window.py, as
hvdlite/common/data_paths/within_node.py drives it), in one process: N simulated ranks are
threads, each with its own SharedWindow over a fake communicator.  The fake gives them one numpy
buffer as the node's shared window (each rank's segment, as MPI's Shared_query would) and a real
rendezvous for every collective call; Ibarrier's test waits briefly on a condition, so the
library's own polite wait (window_barrier) runs unchanged.  The same runs under mpiexec are in
tests/core/test_shm.py (steady.shared_fusion); this file needs no MPI.

The fake checks, at every collective, that all ranks made the same call (a window grown on one
rank only, or a barrier skipped, fails at once), a window Free'd by every rank is poisoned (a
stale view reads NaNs), and every wait has a deadline: a rank whose peer never arrives fails
within seconds instead of hanging the test.

Input values are chosen so that every reduction is exact in any order (small dyadic floats,
powers of two for products, integers that wrap mod 2**32), so results are compared bit for bit
with a plain numpy reference and across ranks.
"""
from __future__ import annotations

import sys
import threading
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest

from hvdlite.common.data_paths.within_node import SharedWindowPath
from hvdlite.common.dtypes import dtype_info, numpy_reduce_ufunc
from hvdlite.common.engine.messages import ALLREDUCE, Response
from hvdlite.common.intranode import shared_window
from hvdlite.common.intranode.shared_window import MIN_SLOT, SharedWindow
from hvdlite.common.reduce_ops import ReduceOp

SIZES = [2, 3, 4]
MiB = 1 << 20
WAIT_S = 10.0    # the fake's deadline for any one collective (a protocol bug fails, not hangs)
JOIN_S = 15.0    # the harness's deadline for every rank's thread


# --- the fake MPI ------------------------------------------------------------------------------
class PeerTimeout(RuntimeError):
    """A rank waited at a collective past the fake's deadline (a peer never arrived)."""


class PeerFailed(RuntimeError):
    """Another rank's thread raised: this rank leaves its collective instead of waiting."""


class World:
    """What the simulated ranks share: the node's memory and the rendezvous of collectives.

    Every collective call of a rank takes the rank's next sequence number; the round completes
    when all ranks have called, and fails on every rank if they called different things."""

    def __init__(self, size: int, timeout: float = WAIT_S, node_size: int | None = None,
                 seed: int = 0) -> None:
        self.size = size
        self.timeout = timeout
        self.node_size = size if node_size is None else node_size   # Split_type's answer
        self.cond = threading.Condition()
        self.seq = [0] * size
        self.rounds: dict[int, dict] = {}
        self.log: list[list[str]] = [[] for _ in range(size)]   # each rank's collective calls
        self.failed: str | None = None
        self.after_barrier = None   # hook(rank, k): called as a rank leaves barrier round k
        self.rng = np.random.default_rng(seed)
        self.windows: list[SimpleNamespace] = []

    def fail(self, why: str) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = why
            self.cond.notify_all()

    def arrive(self, rank: int, name: str, value=None, finish=None) -> int:
        """Enter collective ``name`` (``finish(values by rank)`` computes its result once)."""
        with self.cond:
            self._check(rank)
            k = self.seq[rank]
            self.seq[rank] += 1
            self.log[rank].append(name)
            rnd = self.rounds.setdefault(k, {"names": {}, "values": {}, "done": False})
            rnd["names"][rank], rnd["values"][rank] = name, value
            if len(rnd["names"]) == self.size:
                if len(set(rnd["names"].values())) != 1:
                    rnd["error"] = (f"collective #{k}: the ranks made different calls "
                                    f"{rnd['names']}")
                else:
                    values = [rnd["values"][r] for r in range(self.size)]
                    rnd["result"] = finish(values) if finish else values
                rnd["done"] = True
                self.cond.notify_all()
            return k

    def ready(self, rank: int, k: int, wait: float) -> bool:
        """Whether round ``k`` is complete (waiting up to ``wait`` seconds for it)."""
        with self.cond:
            rnd = self.rounds[k]
            if not rnd["done"] and wait > 0:
                self.cond.wait(wait)
            self._check(rank)
            if rnd["done"] and "error" in rnd:
                raise AssertionError(rnd["error"])
            return rnd["done"]

    def result(self, rank: int, k: int):
        """Block until round ``k`` completes (a blocking collective); its result."""
        deadline = time.monotonic() + self.timeout
        while not self.ready(rank, k, 0.01):
            if time.monotonic() > deadline:
                raise PeerTimeout(self._stuck(rank, k))
        return self.rounds[k]["result"]

    def _check(self, rank: int) -> None:
        if self.failed is not None:
            raise PeerFailed(f"rank {rank} left a collective: {self.failed}")

    def _stuck(self, rank: int, k: int) -> str:
        rnd = self.rounds[k]
        return (f"rank {rank} waited {self.timeout} s at collective #{k} "
                f"({rnd['names'][rank]}); arrived: {sorted(rnd['names'])} of {self.size} ranks")


class Request:
    """Ibarrier's request: Test waits up to 0.5 ms for the round (no busy spin under the GIL)."""

    def __init__(self, world: World, rank: int, k: int) -> None:
        self.world, self.rank, self.k = world, rank, k
        self.started = time.monotonic()

    def Test(self) -> bool:
        if self.world.ready(self.rank, self.k, 0.0005):
            if self.world.after_barrier is not None:
                self.world.after_barrier(self.rank, self.k)
            return True
        if time.monotonic() - self.started > self.world.timeout:
            raise PeerTimeout(self.world._stuck(self.rank, self.k))
        return False


class LocalComm:
    def __init__(self, size: int) -> None:
        self.size = size

    def Get_size(self) -> int:
        return self.size

    def Free(self) -> None:
        pass


class Comm:
    """One rank's communicator: exactly the calls SharedWindow makes."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank

    def Get_size(self) -> int:
        return self.world.size

    def Get_rank(self) -> int:
        return self.rank

    def Ibarrier(self) -> Request:
        return Request(self.world, self.rank, self.world.arrive(self.rank, "Ibarrier"))

    def allreduce(self, value, op):
        assert op is FAKE_MPI.LAND, op
        k = self.world.arrive(self.rank, "allreduce(LAND)", bool(value))
        return all(self.world.result(self.rank, k))

    def Split_type(self, split_type, key=0) -> LocalComm:
        assert split_type is FAKE_MPI.COMM_TYPE_SHARED and key == self.rank
        self.world.result(self.rank, self.world.arrive(self.rank, "Split_type"))
        return LocalComm(self.world.node_size)


class Win:
    """One rank's handle on a shared window: all ranks' segments lie back to back in one numpy
    buffer (filled with random bytes, as MPI does not promise zeros)."""

    def __init__(self, comm: Comm, shared: SimpleNamespace) -> None:
        self.comm, self.shared = comm, shared
        self.locked = False
        self.syncs = 0

    def Lock_all(self, assertion=0) -> None:
        assert not self.locked and not self.shared.freed
        self.locked = True

    def Unlock_all(self) -> None:
        assert self.locked
        self.locked = False

    def Sync(self) -> None:
        assert self.locked and not self.shared.freed, "Win.Sync outside a Lock_all epoch"
        self.syncs += 1

    def Shared_query(self, rank: int):
        start = self.shared.offsets[rank]
        return memoryview(self.shared.buf[start:start + self.shared.sizes[rank]]), 1

    def Free(self) -> None:
        assert not self.locked, "Win.Free inside a Lock_all epoch"

        def poison(_):
            self.shared.buf.fill(0xFF)    # any view kept past Free now reads NaN / -1
            self.shared.freed = True

        world = self.comm.world
        world.result(self.comm.rank, world.arrive(self.comm.rank, "Win.Free", finish=poison))

    @staticmethod
    def Allocate_shared(size, disp_unit=1, info=None, comm=None) -> "Win":
        world = comm.world

        def allocate(sizes):
            offsets = [sum(sizes[:r]) for r in range(len(sizes))]
            buf = np.frombuffer(world.rng.bytes(sum(sizes)), dtype=np.uint8).copy()
            shared = SimpleNamespace(buf=buf, sizes=sizes, offsets=offsets, freed=False)
            world.windows.append(shared)
            return shared

        k = world.arrive(comm.rank, f"Win.Allocate_shared({size}, {disp_unit})", size, allocate)
        return Win(comm, world.result(comm.rank, k))


class Info:
    def __init__(self) -> None:
        self.items: dict[str, str] = {}

    @classmethod
    def Create(cls) -> "Info":
        return cls()

    def Set(self, key: str, value: str) -> None:
        self.items[key] = value

    def Free(self) -> None:
        pass


FAKE_MPI = SimpleNamespace(LAND=object(), COMM_TYPE_SHARED=object(), MODE_NOCHECK=1024,
                           Info=Info, Win=Win)


@pytest.fixture(autouse=True)
def fake_mpi(monkeypatch):
    """``from mpi4py import MPI`` inside shared_window.py finds the fake; /dev/shm has room."""
    try:
        import mpi4py
    except ImportError:
        mpi4py = types.ModuleType("mpi4py")
        monkeypatch.setitem(sys.modules, "mpi4py", mpi4py)
    monkeypatch.setattr(mpi4py, "MPI", FAKE_MPI, raising=False)
    monkeypatch.setattr(shared_window, "shm_space", lambda: 1 << 40)


def run_ranks(world: World, body, join_s: float = JOIN_S) -> list:
    """``body(rank, comm)`` on every rank, each in its own thread; their return values.  A rank
    that raises makes its peers leave their collectives; a thread still running after ``join_s``
    fails the test (it never hangs)."""
    results: list = [None] * world.size
    errors: list = [None] * world.size

    def main(rank: int) -> None:
        try:
            results[rank] = body(rank, Comm(world, rank))
        except BaseException as exc:   # noqa: B902 - reported below, with the rank
            errors[rank] = exc
            world.fail(f"rank {rank} raised {exc!r}")

    threads = [threading.Thread(target=main, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(world.size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        world.fail("the test gave up")
        pytest.fail(f"ranks {hung} still running after {join_s} s (collective calls so far: "
                    f"{[len(calls) for calls in world.log]})")
    first = [(r, e) for r, e in enumerate(errors) if e is not None and not isinstance(e, PeerFailed)]
    first = first or [(r, e) for r, e in enumerate(errors) if e is not None]
    if first:
        rank, exc = first[0]
        raise AssertionError(f"rank {rank} of {world.size}: {exc!r}") from exc
    return results


# --- data and references -----------------------------------------------------------------------
DTYPES = ["float32", "float64", "int32", "float16", "bool"]
OPS = [ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product]
# 79,490 elements: even bool fuses to >= 64 KiB (MIN_BYTES); outputs straddle the shares
SHAPES = [(1,), (33, 7), (9000,), (0,), (17, 3, 5), (70000,), (3,)]


def ops_for(dtype: str) -> list[ReduceOp]:
    return [op for op in OPS if not (dtype == "bool" and op == ReduceOp.Average)]


def values(rng, dtype: str, op: ReduceOp, shape, scaled: bool) -> np.ndarray:
    """Inputs whose reduction is exact in any order."""
    if dtype == "bool":
        return rng.random(shape) < (0.8 if op in (ReduceOp.Min, ReduceOp.Product) else 0.3)
    if dtype == "int32":
        top = 9 if scaled else 1000 if op == ReduceOp.Product else 10 ** 6   # products wrap
        return rng.integers(-top, top + 1, shape, dtype=np.int32)           # mod 2**32, as in MPI
    if op == ReduceOp.Product:   # +-1/2, +-1, +-2
        return np.ldexp(rng.integers(0, 2, shape, dtype=np.int8) * 2 - 1,
                        rng.integers(-1, 2, shape, dtype=np.int8)).astype(dtype)
    top = 32 if dtype == "float16" else 4096
    return (rng.integers(-top, top + 1, shape, dtype=np.int32).astype(dtype) / 4).astype(dtype)


def assert_exact(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not np.array_equal(got, want):   # (fast; the numpy helper only to describe a failure)
        np.testing.assert_array_equal(got, want, err_msg=what)


def scaled(x: np.ndarray, factor: float) -> np.ndarray:
    """Horovod's scaling rule, written out: integers in float64 truncated toward zero, 16-bit
    floats in float32, wider floats in their own type."""
    if factor == 1.0:
        return x.copy()
    if x.dtype.kind in "iub":
        return (x.astype(np.float64) * factor).astype(x.dtype)
    if x.dtype.itemsize >= 4:
        return x * x.dtype.type(factor)
    return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)


def reference(xs: list[np.ndarray], dtype: str, op: ReduceOp, prescale: float,
              postscale: float, plus: float = 0) -> np.ndarray:
    """postscale * (reduce over ranks of prescale * x, + ``plus``); Average divides by size."""
    ufunc = numpy_reduce_ufunc(dtype_info(dtype), op)
    with np.errstate(all="ignore"):
        out = scaled(xs[0], prescale)
        for x in xs[1:]:
            out = ufunc(out, scaled(x, prescale))
        if plus:
            out = out + out.dtype.type(plus)
        factor = postscale * (1.0 / len(xs) if op == ReduceOp.Average else 1.0)
        return scaled(out, factor)


def inputs_by_rank(seed: int, size: int, dtype: str, op: ReduceOp, shapes, scaled_=False):
    rng = np.random.default_rng(seed)
    return [[values(rng, dtype, op, s, scaled_) for s in shapes] for _ in range(size)]


def same_bits_everywhere(per_rank: list[list[np.ndarray]], what: str) -> None:
    for rank in range(1, len(per_rank)):
        for i, (a, b) in enumerate(zip(per_rank[0], per_rank[rank])):
            assert a.tobytes() == b.tobytes(), f"{what}: tensor {i} differs on rank {rank}"


# --- driving the data path as the engine does -------------------------------------------------
def new_path(comm: Comm, window_bytes: int = 8 * MiB, on_slow=None) -> SharedWindowPath:
    context = SimpleNamespace(comm=comm, config=SimpleNamespace(shm_window_bytes=window_bytes),
                              max_sleep=1e-3, on_slow=on_slow)
    return SharedWindowPath(context)


def make_batch(arrays, outputs, dtype: str, op: ReduceOp, prescale: float, postscale: float):
    return [(Response(name=f"t{i}", kind=ALLREDUCE, dtype=dtype, shape=a.shape,
                      reduce_op=int(op), prescale=prescale, postscale=postscale),
             SimpleNamespace(array=a, output=o, stand_in=False))
            for i, (a, o) in enumerate(zip(arrays, outputs))]


def execute(path: SharedWindowPath, xs, dtype, op, prescale=1.0, postscale=1.0,
            in_place="mixed") -> list[np.ndarray]:
    """One allreduce batch of this rank's tensors ``xs`` (copied) through the path; the outputs.
    ``in_place``: "mixed" (every other output is its input), True or False."""
    arrays = [x.copy() for x in xs]
    outputs = [a if (in_place is True or (in_place == "mixed" and i % 2 == 0))
               else np.full_like(a, 7) for i, a in enumerate(arrays)]
    batch = make_batch(arrays, outputs, dtype, op, prescale, postscale)
    assert path.enabled(batch), "the shared window refused a batch it should serve"
    path.execute(batch)
    return outputs


# --- the tests ---------------------------------------------------------------------------------
FUSED_SPECS = ([(d, op, 1.0, 1.0) for d in DTYPES for op in ops_for(d)]
               + [(d, op, 0.5, 3.0) for d in ("float32", "float64", "int32", "float16")
                  for op in OPS])


@pytest.mark.parametrize("size", SIZES)
def test_fused_batches_every_dtype_and_op_exact_and_identical_on_every_rank(size):
    data = [inputs_by_rank(100 + b, size, d, op, SHAPES, pre != 1.0)
            for b, (d, op, pre, _) in enumerate(FUSED_SPECS)]
    world = World(size)

    def body(rank, comm):
        path = new_path(comm)
        outs = [execute(path, xs[rank], d, op, pre, post)
                for xs, (d, op, pre, post) in zip(data, FUSED_SPECS)]
        window = path.window
        counters = (window.batches, window.singles, window.largest_slot_bytes)
        path.close(collective=True)
        return outs, counters

    results = run_ranks(world, body)
    for b, (xs, (d, op, pre, post)) in enumerate(zip(data, FUSED_SPECS)):
        what = f"{size} ranks, {d} {op.name} prescale {pre} postscale {post}"
        for i in range(len(SHAPES)):
            want = reference([xs[r][i] for r in range(size)], d, op, pre, post)
            for rank in range(size):
                out = results[rank][0][b][i]
                assert_exact(out, want, f"{what}: rank {rank} tensor {i}")
        same_bits_everywhere([results[r][0][b] for r in range(size)], what)
    for rank in range(size):
        assert results[rank][1] == (len(FUSED_SPECS), 0, MIN_SLOT)
    assert world.log[0].count("Win.Allocate_shared(%d, 1)" % (2 * MIN_SLOT)) == 1
    assert all(log == world.log[0] for log in world.log)
    assert world.windows[0].freed


SINGLE_SPECS = ([("float32", op, pre, post)
                 for op in (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Max, ReduceOp.Product)
                 for pre, post in ((1.0, 1.0), (0.5, 3.0))]
                + [("float64", ReduceOp.Sum, 0.5, 3.0), ("float64", ReduceOp.Min, 1.0, 1.0),
                   ("int32", ReduceOp.Average, 0.5, 3.0), ("int32", ReduceOp.Product, 1.0, 1.0),
                   ("float16", ReduceOp.Average, 0.5, 3.0), ("float16", ReduceOp.Max, 1.0, 1.0)])


@pytest.mark.parametrize("size", SIZES)
def test_single_large_tensor_in_place_and_out_of_place(size):
    """allreduce_one: each rank publishes only the peers' shares, reduces its own from its input
    (in chunks of _CHUNK_BYTES) and copies the peers' results out."""
    def count(d):   # just over MIN_SINGLE_BYTES, not a multiple of anything
        return MiB // np.dtype(d).itemsize + 4099

    data = [inputs_by_rank(200 + b, size, d, op, [(count(d),)], pre != 1.0)
            for b, (d, op, pre, _) in enumerate(SINGLE_SPECS)]
    world = World(size)

    def body(rank, comm):
        path = new_path(comm)
        outs = [execute(path, xs[rank], d, op, pre, post, in_place=b % 2 == 0)
                for b, (xs, (d, op, pre, post)) in enumerate(zip(data, SINGLE_SPECS))]
        window = path.window
        counters = (window.batches, window.singles)
        path.close(collective=True)
        return outs, counters

    results = run_ranks(world, body)
    for b, (xs, (d, op, pre, post)) in enumerate(zip(data, SINGLE_SPECS)):
        what = f"{size} ranks, single {d} {op.name} prescale {pre} postscale {post}"
        want = reference([xs[r][0] for r in range(size)], d, op, pre, post)
        for rank in range(size):
            assert_exact(results[rank][0][b][0], want, f"{what}: rank {rank}")
        same_bits_everywhere([results[r][0][b] for r in range(size)], what)
    for rank in range(size):
        assert results[rank][1] == (0, len(SINGLE_SPECS))


@pytest.mark.parametrize("size", SIZES)
def test_slow_rank_never_sees_its_copy_out_overwritten(size):
    """Batches back to back while one rank at a time lingers after each barrier (before its
    copy-out or reduction) and another arrives late: the faster ranks pack the next batch into
    the other slot, never into the one the slow rank still reads."""
    batches = 36
    plan = []   # (dtype, op, shapes, single)
    for b in range(batches):
        if b % 3 == 2:
            plan.append(("float32", ReduceOp.Sum, [(MiB // 4 + 37,)], True))
        else:
            plan.append(("float32" if b % 3 == 0 else "int32",
                         ReduceOp.Sum if b % 3 == 0 else ReduceOp.Max, SHAPES[:6], False))
    data = [inputs_by_rank(300 + b, size, d, op, shapes) for b, (d, op, shapes, _) in
            enumerate(plan)]
    world = World(size)
    lingered = []

    def linger(rank, k):
        if rank == (k // 2) % size:      # every barrier, one rank (rotating) is slow to leave
            lingered.append(rank)
            time.sleep(0.002)

    world.after_barrier = linger

    def body(rank, comm):
        path = new_path(comm)
        outs = []
        for b, (d, op, _, _) in enumerate(plan):
            if (b + rank) % size == 0:
                time.sleep(0.001)           # and one rank is late to pack
            outs.append(execute(path, data[b][rank], d, op))
        counters = (path.window.batches, path.window.singles)
        path.close(collective=True)
        return outs, counters

    results = run_ranks(world, body)
    for b, (d, op, _, single) in enumerate(plan):
        what = f"{size} ranks, batch {b} ({d} {op.name}{', single' if single else ''})"
        for i in range(len(data[b][0])):
            want = reference([data[b][r][i] for r in range(size)], d, op, 1.0, 1.0)
            for rank in range(size):
                assert_exact(results[rank][0][b][i], want, f"{what}: rank {rank} tensor {i}")
        same_bits_everywhere([results[r][0][b] for r in range(size)], what)
    singles = sum(1 for p in plan if p[3])
    assert all(results[r][1] == (batches - singles, singles) for r in range(size))
    assert len(set(lingered)) == size


@pytest.mark.parametrize("size", SIZES)
def test_window_grows_on_every_rank_together(size):
    """A batch larger than the slot grows the window (collectively: the old one is freed and
    poisoned, a larger one allocated) on every rank at the same batch; a batch above
    max_batch_bytes is refused by every rank; results stay exact across growths."""
    plan = [  # (total elements of float32, single) -> expected slot bytes after the batch
        ((25_000, False), MIN_SLOT),        # first use: the smallest slot
        ((3 * MiB // 4, False), 4 * MiB),   # 3 MiB fused: grows to the next power of two
        ((50_000, False), 4 * MiB),         # smaller again: no shrinking, no new window
        ((6 * MiB // 4, True), 8 * MiB),    # 6 MiB single tensor: grows again (capped here)
        ((40_000, False), 8 * MiB),
    ]
    data = []
    for b, ((n, single), _) in enumerate(plan):
        shapes = [(n,)] if single else [(n // 3,), (0,), (n - n // 3,)]
        data.append(inputs_by_rank(400 + b, size, "float32", ReduceOp.Sum, shapes))
    world = World(size)

    def body(rank, comm):
        path = new_path(comm, window_bytes=8 * MiB)
        outs, slots = [], []
        for b in range(len(plan)):
            outs.append(execute(path, data[b][rank], "float32", ReduceOp.Sum))
            slots.append(path.window._slot_bytes)
        too_big = np.zeros(8 * MiB // 4 + 16, dtype=np.float32)
        refused = not path.enabled(make_batch([too_big], [too_big], "float32", ReduceOp.Sum,
                                              1.0, 1.0))
        largest = path.window.largest_slot_bytes
        path.close(collective=True)
        return outs, slots, refused, largest

    results = run_ranks(world, body)
    for b in range(len(plan)):
        for i in range(len(data[b][0])):
            want = reference([data[b][r][i] for r in range(size)], "float32", ReduceOp.Sum,
                             1.0, 1.0)
            for rank in range(size):
                assert_exact(results[rank][0][b][i], want, f"batch {b} rank {rank} tensor {i}")
    expected = [slot for _, slot in plan]
    for rank in range(size):
        assert results[rank][1] == expected
        assert results[rank][2], "a batch above max_batch_bytes was accepted"
        assert results[rank][3] == 8 * MiB
    allocs = [c for c in world.log[0] if c.startswith("Win.Allocate_shared")]
    assert allocs == [f"Win.Allocate_shared({2 * s}, 1)" for s in (MIN_SLOT, 4 * MiB, 8 * MiB)]
    assert world.log[0].count("Win.Free") == 3   # two growths and the final close
    assert all(log == world.log[0] for log in world.log)
    assert all(w.freed for w in world.windows) and len(world.windows) == 3


@pytest.mark.parametrize("size", SIZES)
def test_reduce_and_allreduce_one_directly_with_between_and_tiny_counts(size):
    """The calls the hierarchical path makes (any local size, ``between`` combining a share with
    other hosts'), with counts of zero and of fewer elements than one cache line (all of them in
    the last rank's share): ``between`` sees exactly this rank's share, once per element."""
    counts = [0, 0, 5, 3, 16_411, 100_003]   # even: reduce(); odd: allreduce_one()
    rng = np.random.default_rng(500 + size)
    xs = [[values(rng, "float64", ReduceOp.Sum, (n,), False) for n in counts]
          for _ in range(size)]
    world = World(size)

    def body(rank, comm):
        window = SharedWindow(comm, 8 * MiB)
        assert window.usable(MiB)   # allocates the window (thresholds only gate the path)
        dtype = np.dtype(np.float64)
        seen, outs = [], []

        def between(lo, share):
            seen.append((lo, share.size))
            share += 1000.0       # "the other hosts' contribution"

        for b, n in enumerate(counts):
            if b % 2 == 0:   # a fused batch through reduce()
                buf = window.pack_buffer(n, dtype)
                buf[:] = xs[rank][b]
                pieces = window.reduce(n, dtype, np.add, between=between)
                assert [p[0] for p in pieces][:1] in ([], [0])
                assert all(a[1] == c[0] for a, c in zip(pieces, pieces[1:]))
                assert all(stop - start == len(p) for start, stop, p in pieces)
                out = (np.concatenate([p for _, _, p in pieces]) if pieces
                       else np.zeros(0, dtype))
                assert out.size == n
                outs.append(out.copy())   # pieces stay valid only until the batch after next
            else:            # one tensor through allreduce_one, out of place, with scaling
                src = xs[rank][b].copy()
                out = np.full_like(src, np.nan)
                window.allreduce_one(src, out, np.add, 0.5, 3.0, between=between)
                np.testing.assert_array_equal(src, xs[rank][b])   # the input is untouched
                outs.append(out)
        window.close(collective=True)
        return outs, seen

    results = run_ranks(world, body)
    for b, n in enumerate(counts):
        pre, post = (1.0, 1.0) if b % 2 == 0 else (0.5, 3.0)
        want = reference([xs[r][b] for r in range(size)], "float64", ReduceOp.Sum, pre, post,
                         plus=1000.0)
        for rank in range(size):
            assert_exact(results[rank][0][b], want, f"count {n} rank {rank}")
        same_bits_everywhere([[results[r][0][b]] for r in range(size)], f"count {n}")
    for rank in range(size):
        bounds = [SharedWindow.shares(n, 8, size) for n in counts]
        assert results[rank][1] == [(bd[rank], bd[rank + 1] - bd[rank]) for bd in bounds]


def test_usable_is_refused_by_every_rank_off_node_or_without_room(monkeypatch):
    """Not all on one node: no window at all.  Too little room in /dev/shm: every rank gives
    up together (the allreduce of 'fits'), frees nothing it never allocated, and stays off."""
    world = World(3, node_size=2)

    def off_node(rank, comm):
        window = SharedWindow(comm, 8 * MiB)
        return window.usable(MiB), window.usable(MiB)

    assert run_ranks(world, off_node) == [(False, False)] * 3
    assert "Win.Allocate_shared" not in str(world.log)

    # rank 1 alone lacks room (space is this process's, so it is faked per thread)
    room = threading.local()
    monkeypatch.setattr(shared_window, "shm_space", lambda: room.space)
    world = World(3)

    def no_room(rank, comm):
        room.space = 0 if rank == 1 else 1 << 40
        window = SharedWindow(comm, 8 * MiB)
        first = window.usable(MiB)
        return first, window.usable(MiB), window._disabled

    assert run_ranks(world, no_room) == [(False, False, True)] * 3
    assert world.log[0] == ["Split_type", "allreduce(LAND)", "allreduce(LAND)"]


@pytest.mark.parametrize("size", SIZES)
def test_a_peer_that_never_arrives_fails_the_barrier_instead_of_hanging(size):
    """The last rank leaves after the first batch; the others' next barrier gives up at the
    fake's deadline with a clear error, and the test ends within seconds."""
    shapes = SHAPES[:6]
    data = [inputs_by_rank(600 + b, size, "float32", ReduceOp.Sum, shapes) for b in range(2)]
    world = World(size, timeout=0.3)

    def body(rank, comm):
        path = new_path(comm)
        execute(path, data[0][rank], "float32", ReduceOp.Sum)
        if rank == size - 1:
            return "left"
        started = time.monotonic()
        with pytest.raises(PeerTimeout, match=r"arrived: \[[0-9, ]+\] of"):
            execute(path, data[1][rank], "float32", ReduceOp.Sum)
        path.close(collective=False)   # a peer is gone: no collective Free
        return time.monotonic() - started

    started = time.monotonic()
    results = run_ranks(world, body, join_s=5.0)
    assert results[-1] == "left"
    assert all(0.25 < waited < 3.0 for waited in results[:-1])
    assert time.monotonic() - started < 5.0
    assert "Win.Free" not in str(world.log)


def test_stall_checks_can_abandon_a_barrier_whose_peer_never_arrives():
    """The library's own way out: window_barrier calls ``on_slow`` about every second of a wait,
    and an exception from it ends the wait (the engine's stall checks raise there)."""
    size = 3

    class Stalled(Exception):
        pass

    def on_slow(waited):
        raise Stalled(f"peer missing for {waited:.1f} s")

    world = World(size)

    def body(rank, comm):
        window = SharedWindow(comm, 8 * MiB, max_sleep=1e-3, on_slow=on_slow)
        assert window.usable(MiB)
        if rank == 0:
            return "left"
        buf = window.pack_buffer(1000, np.dtype(np.float32))
        buf[:] = rank
        with pytest.raises(Stalled):
            window.reduce(1000, np.dtype(np.float32), np.add)
        window.close(collective=False)
        return "stalled"

    assert run_ranks(world, body, join_s=5.0) == ["left", "stalled", "stalled"]


def test_the_harness_reports_a_failing_rank_without_hanging_its_peers():
    """A rank that raises makes its peers leave the collective they wait in at once."""
    world = World(3)

    def body(rank, comm):
        if rank == 1:
            raise ValueError("boom")
        comm.allreduce(True, op=FAKE_MPI.LAND)

    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 of 3: ValueError"):
        run_ranks(world, body)
    assert time.monotonic() - started < 2.0


def test_the_fake_rejects_ranks_that_disagree_on_a_collective():
    """A window grown on one rank but not another fails at once on every rank."""
    world = World(2)

    def body(rank, comm):
        Win.Allocate_shared(2 * MiB if rank == 0 else 4 * MiB, 1, comm=comm)

    with pytest.raises(AssertionError, match="different calls"):
        run_ranks(world, body)
