"""The negotiation round protocol, driven in one process: N simulated ranks, each with its own
Controller in its own thread, over an in-process transport (fake_transport.py).  Rounds are
collective, so every rank runs the same number; each test scripts what every rank submits in
each round and checks what each rank is told to execute, and in which order."""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from hvdlite.common.api.grouped import group_request
from hvdlite.common.config import Config
from hvdlite.common.engine.controller import Controller
from hvdlite.common.engine.handle import Entry, Handle
from hvdlite.common.engine.messages import (ALLREDUCE, ERROR_FAILED_ON_RANK, ERROR_MISMATCH,
                                            ERROR_STALL, FAILED,
                                            JOIN, Request)
from hvdlite.common.reduce_ops import ReduceOp
from tests.unit.engine.fake_transport import FakeNetwork

CONFIG = Config(stall_check_seconds=60.0)


def entry(name: str, shape=(4,), dtype="float32", kind=ALLREDUCE, cacheable=True,
          failure="") -> Entry:
    request = Request(name, kind, dtype, shape, int(ReduceOp.Sum), cacheable=cacheable,
                      failure=failure)
    array = None if kind in (JOIN, FAILED) else np.zeros(shape, dtype=dtype)
    return Entry(request, array, array, None, Handle(name, lambda: True))


def grouped(group: str, members: list[Entry]) -> list[Entry]:
    """A grouped allreduce of ``members``: one entry (see group_request)."""
    whole = Entry(group_request(group, members, True), None, None, None,
                  Handle(group, lambda: True))
    whole.members = members
    return [whole]


@dataclasses.dataclass
class RankLog:
    ready: list[list[tuple[str, str | None, str | None]]]   # per round: (name, error kind, err)
    joined: list = dataclasses.field(default_factory=list)
    shutdown_ranks: list = dataclasses.field(default_factory=list)
    early: list = dataclasses.field(default_factory=list)   # per round: the early name or None
    sole: list = dataclasses.field(default_factory=list)    # per round: outcome.sole_slot
    allowed: list = dataclasses.field(default_factory=list)  # per round: early_allowed
    controller: Controller | None = None


def run(size: int, script, rounds: int, config: Config = CONFIG, pause: float = 0.0,
        early=None, early_on=lambda rank, rnd: True):
    """``script(rank, round) -> (new entries, shutdown?)``; runs ``rounds`` rounds on every
    rank (each in its own thread) and returns each rank's RankLog and the network.
    ``early(rank, round)``: the round's early reduction, ``(slot, start)``, or None;
    ``early_on(rank, round)``: whether the rank has early reductions switched on."""
    network = FakeNetwork(size)
    logs = [RankLog([]) for _ in range(size)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            controller = Controller(network.transport(rank), config, {}, list(range(size)))
            logs[rank].controller = controller
            for rnd in range(rounds):
                new, shutdown = script(rank, rnd)
                outcome = controller.run_round(list(new), shutdown,
                                               None if early is None else early(rank, rnd),
                                               early_on(rank, rnd))
                logs[rank].allowed.append(outcome.early_allowed)
                logs[rank].early.append(None if outcome.early is None
                                        else outcome.early[0].name)
                logs[rank].sole.append(outcome.sole_slot)
                logs[rank].ready.append([(m.name, r.error_kind, r.error)   # groups: members
                                         for r, e in outcome.ready for m in r.members or (r,)])
                if outcome.joined is not None:
                    logs[rank].joined.append((rnd, outcome.joined[1]))
                logs[rank].shutdown_ranks.append(outcome.shutdown_ranks)
                if pause:
                    time.sleep(pause)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    assert not errors, errors
    return logs, network


def names(log: RankLog, rnd: int) -> list[str]:
    return [name for name, _, _ in log.ready[rnd]]


@pytest.mark.parametrize("size", [2, 3])
def test_first_round_negotiates_later_rounds_hit_the_cache(size):
    logs, network = run(size, lambda rank, rnd: ([entry("x")], False), rounds=3)
    for log in logs:
        assert [names(log, r) for r in range(3)] == [["x"], ["x"], ["x"]]
    # the full requests travel once (round 0); later rounds are one AND each
    assert all(network.messages_sent[(rank, "requests")] == 1 for rank in range(1, size))
    assert logs[0].controller.cache.slot_of.keys() == {"x"}


def test_auto_named_tensors_are_not_cached():
    logs, network = run(2, lambda rank, rnd: ([entry(f"n{rnd}", cacheable=False)], False), 3)
    assert [names(logs[1], r) for r in range(3)] == [["n0"], ["n1"], ["n2"]]
    assert network.messages_sent[(1, "requests")] == 3
    assert not logs[1].controller.cache.slot_of


@pytest.mark.parametrize("size", [2, 3])
def test_submission_order_may_differ_execution_order_does_not(size):
    def script(rank, rnd):
        if rnd:
            return [], False
        order = ["a", "b", "c"]
        return [entry(n) for n in (order if rank % 2 == 0 else order[::-1])], False
    logs, _ = run(size, script, rounds=2)
    first = names(logs[0], 0)
    assert sorted(first) == ["a", "b", "c"]
    assert all(names(log, 0) == first for log in logs)


def test_a_tensor_runs_in_the_round_its_last_rank_submits_it():
    def script(rank, rnd):
        return ([entry("late")] if (rank, rnd) in {(0, 0), (1, 2)} else []), False
    logs, _ = run(2, script, rounds=4)
    for log in logs:
        assert [names(log, r) for r in range(4)] == [[], [], ["late"], []]


def test_cached_tensor_late_on_one_rank_waits_for_it():
    def script(rank, rnd):
        if rnd == 0 or (rnd == 1 and rank == 0) or (rnd == 3 and rank == 1):
            return [entry("c")], False
        return [], False
    logs, network = run(2, script, rounds=5)
    for log in logs:
        assert [names(log, r) for r in range(5)] == [["c"], [], [], ["c"], []]
    assert network.messages_sent[(1, "requests")] == 1   # round 0 only: the rest is cached


@pytest.mark.parametrize("size", [2, 3])
def test_mismatch_fails_the_tensor_on_every_rank(size):
    def script(rank, rnd):
        return ([entry("m", shape=(4,) if rank else (5,))] if rnd == 0 else []), False
    logs, _ = run(size, script, rounds=2)
    for log in logs:
        [(name, kind, error)] = log.ready[0]
        assert name == "m" and kind == "mismatch" and "shape" in error


def test_changed_signature_under_a_cached_name_is_negotiated_again():
    def script(rank, rnd):
        shape = (8,) if (rnd == 1 and rank == 1) else (4,)
        return [entry("s", shape=shape)], False
    logs, _ = run(2, script, rounds=3)
    for log in logs:
        assert [log.ready[r][0][:2] for r in range(3)] == [("s", None), ("s", "mismatch"),
                                                          ("s", None)]


def test_failed_stand_in_fails_the_operation_everywhere():
    def script(rank, rnd):
        if rnd:
            return [], False
        if rank == 1:
            return [entry("f", kind=FAILED, cacheable=False, failure="ValueError: bad")], False
        return [entry("f", cacheable=False)], False
    logs, _ = run(3, script, rounds=1)
    for log in logs:
        [(name, kind, error)] = log.ready[0]
        assert (name, kind) == ("f", ERROR_FAILED_ON_RANK)
        assert "ranks [1]" in error and "ValueError: bad" in error


def test_a_group_is_released_together_once_every_member_is_everywhere():
    def script(rank, rnd):
        if (rnd, rank) in ((0, 0), (1, 1)):
            return grouped("g", [entry("g.0"), entry("g.1")]), False
        return [], False
    logs, _ = run(2, script, rounds=3)
    for log in logs:
        assert [names(log, r) for r in range(3)] == [[], ["g.0", "g.1"], []]


def test_a_group_fails_as_one_when_a_member_mismatches():
    def script(rank, rnd):
        if rnd:
            return [], False
        return grouped("h", [entry("h.0"), entry("h.1", shape=(2,) if rank else (4,))]), False
    logs, _ = run(2, script, rounds=1)
    for log in logs:
        [(name, kind, error)] = log.ready[0]
        assert name == "h" and kind == ERROR_MISMATCH
        assert "because of its member 'h.1'" in error


def test_a_cached_group_with_one_changed_member_is_negotiated_again_as_one():
    """Rounds 0-1 cache a 3-member group; in round 2 one member changes shape on every rank
    (a cache miss for it, hits for the others): the whole group goes back to the coordinator
    and is released together, correctly, in that round; round 3 hits the cache again."""
    def script(rank, rnd):
        return grouped("c", [entry("c.0"), entry("c.1", shape=(6,) if rnd >= 2 else (4,)),
                             entry("c.2")]), False
    logs, network = run(2, script, rounds=4)
    for log in logs:
        for rnd in range(4):
            assert sorted(log.ready[rnd]) == [("c.0", None, None), ("c.1", None, None),
                                              ("c.2", None, None)], (rnd, log.ready[rnd])
    # rank 1 sent full requests in round 0 and again for the changed group in round 2 only
    assert network.messages_sent[(1, "requests")] == 2


def test_a_name_in_flight_is_refused_and_a_group_is_admitted_as_one_entry():
    """Admission: a second operation under a name in flight raises DuplicateNameError naming
    it and changes nothing; a group is one entry in the table (its members are not)."""
    from hvdlite.common.engine.admission import Admission
    from hvdlite.common.engine.completion import Completion
    from hvdlite.common.engine.in_flight import InFlight
    from hvdlite.common.errors import DuplicateNameError
    table = InFlight()   # only the admission stage: no communicator, no thread
    admission = Admission(table, 0, lambda: False, Config(), Completion(table, 0))
    first = entry("m.7")
    admission.submit(first)
    with pytest.raises(DuplicateNameError, match="'m.7'"):
        admission.submit(entry("m.7"))
    assert table.entries == {"m.7": first}
    [group] = grouped("m.group200", [entry(f"m.{i}") for i in range(200)])
    admission.submit_group(group)
    assert set(table.entries) == {"m.7", "m.group200"}


def test_submit_returns_the_handle_even_if_the_engine_completes_the_entry_first():
    """The engine thread may take a queued entry, run it and complete it (which hands the
    entry's handle over and clears ``entry.handle``) before the submitting thread runs again,
    as on a loaded machine.  submit must still return the entry's handle, with the result: it
    once returned None there, so a group's GroupHandle had no handle and its wait() returned
    [] at once, and a DistributedOptimizer kept its own unreduced gradients (Keras-torch
    ranks ended with different weights)."""
    from hvdlite.common.engine.admission import Admission
    from hvdlite.common.engine.completion import Completion
    from hvdlite.common.engine.handle import GroupHandle
    from hvdlite.common.engine.in_flight import InFlight
    table = InFlight()
    completion = Completion(table, 0)
    admission = Admission(table, 0, lambda: False, Config(), completion)

    class EngineFirst:   # the queue of an engine thread that finishes before submit returns
        def put(self, queued):
            if queued.members is None:
                completion.complete(queued, queued.output)
            else:
                for member in queued.members:
                    member.handle._complete()

    admission._queue = EngineFirst()
    one = entry("solo")
    handle = admission.submit(one)
    assert one.handle is None   # completed and handed over before submit returned
    assert handle is not None and handle.wait() is one.output
    members = [entry(f"g.{i}") for i in range(3)]
    [group] = grouped("g.group3", members)
    handle = GroupHandle("g.group3", admission.submit_group(group))
    assert handle.wait() == [m.output for m in members]
    assert table.entries == {}


def test_joined_rank_stands_in_for_reductions_and_join_ends_when_all_joined():
    def script(rank, rnd):
        if rank == 1 and rnd == 0:
            return [entry("join", kind=JOIN, shape=())], False
        if rank == 0 and rnd == 1:
            return [entry("r")], False
        if rank == 0 and rnd == 3:
            return [entry("join", kind=JOIN, shape=())], False
        return [], False
    logs, _ = run(2, script, rounds=5)
    assert "r" in names(logs[0], 1) and "r" in names(logs[1], 1)   # rank 1 contributed
    assert logs[0].joined == logs[1].joined == [(3, 0)]   # rank 0 joined last, in round 3


def test_shutdown_is_seen_by_every_rank_in_the_same_round():
    logs, _ = run(3, lambda rank, rnd: ([], rank == 2 and rnd == 1), rounds=3)
    for log in logs:
        assert log.shutdown_ranks[1] == (2,) and log.shutdown_ranks[0] == ()


def test_a_tensor_missing_on_a_rank_fails_after_the_stall_shutdown_time():
    config = Config(stall_check_seconds=60.0, stall_shutdown_seconds=0.2)
    logs, _ = run(2, lambda rank, rnd: ([entry("w")] if rank == 0 and rnd == 0 else [], False),
                  rounds=12, config=config, pause=0.05)
    got = [item for rnd in logs[0].ready for item in rnd]
    assert [(n, k) for n, k, _ in got] == [("w", ERROR_STALL)]   # shutdown < check: honoured
    assert "missing on ranks [1]" in got[0][2] and "rank 1 has no operation pending" in got[0][2]
    assert not [item for rnd in logs[1].ready for item in rnd]   # rank 1 never had it


# --- early reductions (engine/early.py) ------------------------------------------------------
def early_from(first_round: int, slot: int = 0):
    """An ``early`` for :func:`run`: from ``first_round`` on, every rank starts ``slot`` early;
    returns it and the entries each rank's start was given, per (rank, round)."""
    given = {}

    def early(rank, rnd):
        if rnd < first_round:
            return None

        def start(entry):
            given[(rank, rnd)] = entry
            return lambda: True
        return slot, start
    return early, given


@pytest.mark.parametrize("size", [2, 3])
def test_a_cached_tensor_alone_in_its_round_is_the_sole_slot(size):
    logs, _ = run(size, lambda rank, rnd: ([entry("x")], False), rounds=3)
    for log in logs:
        assert log.sole == [None, 0, 0]   # round 0 negotiated it in full


def test_two_cached_tensors_in_a_round_have_no_sole_slot():
    logs, _ = run(2, lambda rank, rnd: ([entry("x"), entry("y")], False), rounds=2)
    assert logs[0].sole == logs[1].sole == [None, None]


@pytest.mark.parametrize("size", [2, 3])
def test_an_early_reduction_stands_when_every_rank_contributed(size):
    early, given = early_from(1)
    logs, _ = run(size, lambda rank, rnd: ([entry("x")], False), rounds=3, early=early)
    for rank, log in enumerate(logs):
        assert log.early == [None, "x", "x"]
        assert [names(log, r) for r in range(3)] == [["x"], [], []]   # not run again
        assert all(given[(rank, rnd)].name == "x" for rnd in (1, 2))
        assert not log.controller.pending


def test_an_early_reduction_is_dropped_when_a_rank_has_not_submitted():
    early, given = early_from(1)

    def script(rank, rnd):
        return ([entry("x")] if rnd != 1 or rank == 0 else []), False
    logs, _ = run(2, script, rounds=3, early=early)
    assert given[(1, 1)] is None and given[(0, 1)].name == "x"
    for log in logs:
        assert log.early == [None, None, "x"]   # round 2: rank 1's x arrived, x stands
        assert [names(log, r) for r in range(3)] == [["x"], [], []]


def test_an_early_reduction_is_dropped_for_a_changed_signature():
    early, given = early_from(1)

    def script(rank, rnd):
        return [entry("x", shape=(5,) if (rank, rnd) == (0, 1) else (4,))], False
    logs, _ = run(2, script, rounds=2, early=early)
    assert given[(0, 1)] is None   # its x no longer matches the cached slot
    for log in logs:
        assert log.early == [None, None]
    # the mismatch is then found in full, as without early reductions
    assert [e for _, e, _ in logs[1].ready[1]] == ["mismatch"]


def test_an_early_reduction_is_dropped_when_a_rank_joins():
    early, _ = early_from(1)

    def script(rank, rnd):
        if rnd == 1 and rank == 1:
            return [entry("j", kind=JOIN)], False
        return ([entry("x")] if rnd == 0 or rank == 0 else []), False
    logs, _ = run(2, script, rounds=2, early=early)
    assert logs[0].early == logs[1].early == [None, None]
    assert names(logs[0], 1) == ["x"]   # run as usual, rank 1 standing in
    assert logs[0].sole[1] is None and logs[1].sole[1] is None


def test_early_reductions_are_allowed_only_while_every_rank_has_them_on():
    # rank 1 switches off in round 1 and on again in round 3: the verdict is the same everywhere
    logs, _ = run(3, lambda rank, rnd: ([], False), rounds=5,
                  early_on=lambda rank, rnd: not (rank == 1 and rnd in (1, 2)))
    for log in logs:
        assert log.allowed == [True, False, False, True, True]
