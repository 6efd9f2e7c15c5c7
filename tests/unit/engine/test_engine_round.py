"""A whole engine round end to end at N simulated ranks in one process: N real engines (admission,
negotiation, fusion planning, execution, completion, each on its own engine thread) talk through
the fake transport, and a fake data path moves the bytes between them in memory.  Each rank
submits single allreduces, a grouped allreduce and a grouped allgather (each negotiated as one
request, members' first dimensions differing across ranks for the allgather); every handle must complete with the right numbers, the
ranks must plan the same fused batches, and a second step must run from the response cache
without any request message."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from hvdlite.common.api.grouped import group_request
from hvdlite.common.api.submission import make_entry
from hvdlite.common.config import Config
from hvdlite.common.engine.engine import Engine
from hvdlite.common.engine.execution import FUSE_BELOW_BYTES
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import ALLGATHER, ALLREDUCE
from hvdlite.common.reduce_ops import ReduceOp
from tests.unit.engine.fake_transport import FakeNetwork

BIG = FUSE_BELOW_BYTES // 8 + 8   # float64 elements: one tensor too large to fuse


class FakeWire:
    """The data paths' shared medium: the k-th batch of every rank meets the k-th batch of the
    others (every rank executes the same batches in the same order)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._parts: dict[int, dict[int, list]] = {}

    def exchange(self, index: int, rank: int, arrays: list) -> list[list]:
        """Every rank's ``arrays`` for batch ``index``, in rank order (blocks until all came)."""
        with self._cond:
            self._parts.setdefault(index, {})[rank] = [a.copy() for a in arrays]
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(self._parts[index]) == self.size, 20.0):
                raise TimeoutError(f"batch {index}: only ranks {sorted(self._parts[index])}")
            return [self._parts[index][r] for r in range(self.size)]


class FakePath:
    """A host data path over :class:`FakeWire`: allreduce (Sum, Average) and allgather."""

    name = "fake"
    device = False
    reduces_early = False

    def __init__(self, wire: FakeWire, rank: int) -> None:
        self.wire, self.rank = wire, rank
        self.batches: list[list[str]] = []   # the names in each batch, in execution order

    def enabled(self, batch) -> bool:
        return True

    def execute(self, batch) -> None:
        self.batches.append([response.name for response, _ in batch])
        every = self.wire.exchange(len(self.batches), self.rank,
                                   [entry.array for _, entry in batch])
        for i, (response, entry) in enumerate(batch):
            parts = [per_rank[i] for per_rank in every]
            if response.kind == ALLREDUCE:
                total = sum(p * response.prescale for p in parts)
                if response.reduce_op == ReduceOp.Average:
                    total = total / len(parts)
                entry.output[...] = total * response.postscale
            else:
                assert response.kind == ALLGATHER, response.kind
                entry.output = np.concatenate(parts)

    def close(self, collective: bool, abort: bool = False) -> None:
        pass


def values(rank: int, n: int, dtype) -> np.ndarray:
    return (np.arange(n) + 10 * rank).astype(dtype)


def submit_step(engine: Engine, rank: int) -> dict:
    """One rank's step; the handles by what they should yield."""
    handles = {}
    for name, n, dtype, op in (("a", 4, np.float32, ReduceOp.Sum),
                               ("b", 3, np.float32, ReduceOp.Average),
                               ("c", BIG, np.float64, ReduceOp.Sum)):
        entry = make_entry(engine, None, ALLREDUCE, values(rank, n, dtype), name,
                           reduce_op=op, postscale_factor=2.0 if name == "c" else 1.0)
        handles[name] = engine.submit(entry)
    members = [make_entry(engine, None, ALLREDUCE, values(rank, n, dtype), f"g.{i}")
               for i, (n, dtype) in enumerate(((5, np.float32), (2, np.float32),
                                               (6, np.float64)))]
    handles["g"] = submit_group(engine, "g.group3", members)
    gathers = [make_entry(engine, None, ALLGATHER, np.full((rank + 1, 2), rank + i, np.int32),
                          f"ag.{i}") for i in range(2)]
    handles["ag"] = submit_group(engine, "ag.group2", gathers)
    return handles


def submit_group(engine: Engine, name: str, members: list[Entry]):
    group = Entry(group_request(name, members, True), None, None, None,
                  engine.new_handle(name))
    group.members = members
    return engine.submit_group(group)


def check_step(handles: dict, size: int) -> None:
    ranks = range(size)
    sum_of = lambda n, dtype: sum(values(r, n, dtype) for r in ranks)   # noqa: E731
    np.testing.assert_array_equal(handles["a"].wait(10), sum_of(4, np.float32))
    np.testing.assert_allclose(handles["b"].wait(10), sum_of(3, np.float32) / size)
    np.testing.assert_array_equal(handles["c"].wait(10), 2 * sum_of(BIG, np.float64))
    group = handles["g"].wait(10)
    assert [r.dtype for r in group] == [np.float32, np.float32, np.float64]
    for result, n in zip(group, (5, 2, 6)):
        np.testing.assert_array_equal(result, sum_of(n, result.dtype))
    gathered = handles["ag"].wait(10)
    assert len(gathered) == 2
    for i, result in enumerate(gathered):
        expected = np.concatenate([np.full((r + 1, 2), r + i, np.int32) for r in ranks])
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("size", [2, 3])
def test_a_round_end_to_end_at_n_simulated_ranks(size):
    network, wire = FakeNetwork(size), FakeWire(size)
    config = Config(stall_check_seconds=60.0)
    paths = [FakePath(wire, rank) for rank in range(size)]
    engines = [Engine(None, config, None, lambda context, p=paths[rank]: [p],
                      transport=network.transport(rank)) for rank in range(size)]
    try:
        # Everything is queued before the threads start, so the first round takes all of it:
        # negotiated in full (nothing is cached yet), in one agreed order.
        steps = [submit_step(engine, rank) for rank, engine in enumerate(engines)]
        for engine in engines:
            engine.start()
        for handles in steps:
            check_step(handles, size)
        batches = [p.batches for p in paths]
        assert all(b == batches[0] for b in batches), batches
        # fusion planning, in the coordinator's order (rank 0's submissions): the small
        # float32 sums (a single allreduce and the group's members) share one batch; an
        # average, the group's float64 member and a tensor too large to fuse run alone; the
        # two small int32 allgathers share one batch of their own
        assert batches[0] == [["a", "g.0", "g.1"], ["b"], ["c"], ["g.2"], ["ag.0", "ag.1"]]
        requests_sent = {r: network.messages_sent[(r, "requests")] for r in range(1, size)}
        assert all(n >= 1 for n in requests_sent.values())
        # the second step: every tensor hits the response cache on every rank, so the rounds
        # are the AND alone (no request message), with the same results
        for handles in [submit_step(engine, rank) for rank, engine in enumerate(engines)]:
            check_step(handles, size)
        assert requests_sent == {r: network.messages_sent[(r, "requests")]
                                 for r in range(1, size)}
        assert all(not engine.in_flight.entries for engine in engines)
    finally:
        closers = [threading.Thread(target=engine.shutdown, args=(10.0,)) for engine in engines]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join()
    assert not any(engine.alive() for engine in engines)


def test_the_agreement_before_a_gpu_batch_goes_through_the_transport():
    """Execution.agree_prepared at 3 simulated ranks: when every rank prepared its part, nobody
    raises; when rank 1 failed, every rank raises naming it (rank 1 with its own cause), so no
    rank enters the collective alone."""
    size = 3
    network = FakeNetwork(size)
    engines = [Engine(None, Config(), None, lambda context: [],
                      transport=network.transport(rank)) for rank in range(size)]
    for failing in (None, 1):
        errors: dict[int, BaseException | None] = {}

        def agree(rank: int) -> None:
            mine = RuntimeError("out of device memory") if rank == failing else None
            try:
                engines[rank].execution.agree_prepared(mine)
                errors[rank] = None
            except Exception as exc:   # noqa: BLE001 - the test looks at it
                errors[rank] = exc
        threads = [threading.Thread(target=agree, args=(rank,)) for rank in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        if failing is None:
            assert errors == {0: None, 1: None, 2: None}
        else:
            assert all("[1]" in str(errors[rank]) for rank in range(size)), errors
            assert "out of device memory" in str(errors[1])
