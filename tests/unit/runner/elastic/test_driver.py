"""The elastic driver's loop over worlds with an in-process provider: no launcher, no Ray, no
Spark, only the protocol (what the workers report to the commit server, and what the provider
sees of them) and the rules the driver draws from it (hvdlite.runner.elastic.driver)."""
from __future__ import annotations

import dataclasses
import queue
import time
from typing import Callable, Optional

import pytest

from hvdlite.common.core import HostUpdateResult
from hvdlite.runner.elastic import driver as drivermod
from hvdlite.runner.elastic.driver import RESET_LIMIT_MESSAGE, Discoverer, ElasticDriver
from hvdlite.runner.elastic.provider import WorldRecord, WorldStartError
from hvdlite.runner.elastic.server import Event, Member


class JobError(Exception):
    pass


class Hosts:
    """A discovery whose answer the test changes."""

    def __init__(self, hosts: dict[str, int]) -> None:
        self.hosts = dict(hosts)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self.hosts)


class FakeServer:
    """The commit server as the driver sees it: an event queue, and worlds to forget."""

    key = b"k" * 32
    port = 1

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.forgotten: list[int] = []

    def forget(self, world: int) -> None:
        self.forgotten.append(world)


class Coordinator(Member):
    """Rank 0, which records the host updates it is sent."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[tuple] = []

    def send(self, message: tuple) -> bool:
        self.sent.append(message)
        return True


# A script says what each world's workers do, one function per world index: it gets the world
# and a `report(rank, kind, text)` / `lose(rank)` kit, and returns when the world has ended.
Script = Callable[["Kit"], None]


@dataclasses.dataclass
class Kit:
    world: WorldRecord
    server: FakeServer
    provider: "FakeProvider"

    def hello_all(self) -> None:
        for rank, host in self.world.host_of.items():
            cls = Coordinator if rank == 0 else Member
            member = cls(self.world.index, rank, self.world.size, host, 1)
            self.server.events.put(Event("hello", member, time.monotonic()))
            self.provider.members[(self.world.index, rank)] = member

    def report(self, rank: int, kind: str, text: str = "") -> None:
        member = self.provider.members[(self.world.index, rank)]
        member.outcome = (kind, text, [])
        self.server.events.put(Event("outcome", member, time.monotonic()))

    def lose(self, rank: int) -> None:
        member = self.provider.members[(self.world.index, rank)]
        member.ended_at = time.monotonic()
        self.server.events.put(Event("ended", member, member.ended_at))


class FakeProvider:
    host_word = "host"
    report_grace = 0.5

    def __init__(self, scripts: list[Script], blacklists: bool = True,
                 retries_own_errors: bool = True) -> None:
        self.scripts = scripts
        self.blacklists = blacklists
        self.retries_own_errors = retries_own_errors
        self.server = FakeServer()
        self.members: dict[tuple[int, int], Member] = {}
        self.worlds: list[WorldRecord] = []
        self.stopped: list[tuple[int, bool]] = []
        self.finished: list[tuple[int, bool]] = []
        self.running: Optional[Script] = None

    def host_name(self, host: str) -> str:
        return host

    def start(self, world: WorldRecord, env: dict[str, str]) -> None:
        assert env["HVDLITE_ELASTIC_WORLD"] == str(world.index)
        self.worlds.append(world)
        script = self.scripts[world.index]
        kit = Kit(world, self.server, self)
        world.handle = {"kit": kit, "script": script, "ended": False, "polls": 0}

    def poll(self, world: WorldRecord, timeout: float) -> bool:
        handle = world.handle
        handle["polls"] += 1
        if handle["polls"] == 1:   # the first look: the script plays the world out
            handle["ended"] = handle["script"](handle["kit"]) is not False
        return handle["ended"]

    def stop(self, world: WorldRecord, hard: bool, signum: Optional[int] = None) -> None:
        self.stopped.append((world.index, hard))
        world.handle["ended"] = True

    def settle(self, world: WorldRecord) -> None:
        pass   # nothing outlives the world's end but its workers' reports

    def finish(self, world: WorldRecord, failed: bool) -> None:
        self.finished.append((world.index, failed))

    def error(self, world: WorldRecord, rank: int) -> BaseException:
        return JobError(f"own error of rank {rank}: {world.raised[rank]}")

    def result(self, world: WorldRecord) -> list:
        return [world.results[r] for r in sorted(world.results)]


@dataclasses.dataclass
class Settings:
    start_np: int = 2
    min_np: int = 2
    max_np: Optional[int] = None
    discovery: object = None
    reset_limit: Optional[int] = None
    cooldown_range: Optional[tuple] = None
    elastic_timeout: float = 5.0


def make(scripts: list[Script], hosts: dict[str, int], said: Optional[list] = None,
         **kwargs) -> tuple[ElasticDriver, FakeProvider, Discoverer, Hosts]:
    provider_args = {k: kwargs.pop(k) for k in ("blacklists", "retries_own_errors")
                     if k in kwargs}
    provider = FakeProvider(scripts, **provider_args)
    discovery = Hosts(hosts)
    settings = Settings(discovery=discovery, **kwargs)
    said = [] if said is None else said
    driver = ElasticDriver(provider, settings, said.append, JobError,
                           lambda need, have, text: JobError(f"timeout: need {need}, have "
                                                             f"{have} ({text})"))
    return driver, provider, Discoverer(discovery, said.append), discovery


def run(driver: ElasticDriver, provider: FakeProvider, discoverer: Discoverer):
    try:
        return driver.run(provider.server, discoverer)
    finally:
        discoverer.stop()


def finishes(kit: Kit) -> None:
    kit.hello_all()
    for rank in kit.world.host_of:
        kit.report(rank, "done")
        kit.world.results[rank] = f"w{kit.world.index}r{rank}"


def loses_rank(rank: int) -> Script:
    def script(kit: Kit) -> None:
        kit.hello_all()
        kit.lose(rank)
        for other in kit.world.host_of:
            if other != rank:
                kit.report(other, "reset", f"RankExitedError: rank {rank} exited")
    return script


def raises_on(rank: int) -> Script:
    def script(kit: Kit) -> None:
        kit.hello_all()
        kit.report(rank, "error", "ValueError: a bug")
        for other in kit.world.host_of:
            if other != rank:
                kit.report(other, "reset", "RankExitedError")
    return script


def test_a_world_that_finishes_ends_the_job_with_the_providers_result():
    driver, provider, discoverer, _ = make([finishes], {"a": 2})
    assert run(driver, provider, discoverer) == ["w0r0", "w0r1"]
    assert provider.finished == [(0, False)] and provider.server.forgotten == [0]


def test_a_lost_rank_blacklists_its_host_and_the_next_world_runs_on_the_others():
    said: list[str] = []
    driver, provider, discoverer, _ = make([loses_rank(1), finishes], {"a": 1, "b": 1,
                                                                         "c": 1},
                                           said=said, start_np=3)
    assert run(driver, provider, discoverer) == ["w1r0", "w1r1"]
    assert [w.placement for w in provider.worlds] == [[("a", 1), ("b", 1), ("c", 1)],
                                                      [("a", 1), ("c", 1)]]
    assert driver.manager.is_blacklisted("b")
    assert any("rank 1 on b exited without a word" in m and "blacklisted b" in m
               for m in said), said
    assert provider.finished == [(0, True), (1, False)]


def test_a_provider_that_does_not_blacklist_reuses_the_host():
    driver, provider, discoverer, _ = make([loses_rank(1), finishes], {"a": 2},
                                           blacklists=False)
    assert run(driver, provider, discoverer) == ["w1r0", "w1r1"]
    assert not driver.manager.is_blacklisted("a")


def test_every_host_blacklisted_stops_the_job():
    driver, provider, discoverer, _ = make([loses_rank(1)], {"a": 2})
    with pytest.raises(JobError, match="every host of world 0 .* failed and is blacklisted"):
        run(driver, provider, discoverer)


def test_the_reset_limit_stops_the_job_after_that_many_new_worlds():
    driver, provider, discoverer, _ = make([loses_rank(1)] * 3, {"a": 2}, blacklists=False,
                                           reset_limit=2)
    with pytest.raises(JobError) as info:
        run(driver, provider, discoverer)
    assert str(info.value) == RESET_LIMIT_MESSAGE.format(2)
    assert len(provider.worlds) == 3   # the first world, then two resets


def test_a_ranks_own_error_is_retried_without_its_host_or_ends_the_job():
    # Horovod's rule (hvdlite run): the host is blamed, and the job goes on without it.
    driver, provider, discoverer, _ = make([raises_on(1), finishes], {"a": 1, "b": 1,
                                                                       "c": 1}, start_np=3)
    assert run(driver, provider, discoverer) == ["w1r0", "w1r1"]
    assert driver.manager.is_blacklisted("b")
    # A provider that does not retry (Ray, Spark) ends the job with the error.
    driver, provider, discoverer, _ = make([raises_on(1)], {"a": 2},
                                           retries_own_errors=False)
    with pytest.raises(JobError, match="own error of rank 1: ValueError: a bug"):
        run(driver, provider, discoverer)
    assert provider.finished == [(0, True)]


def test_every_rank_failing_on_its_own_stops_the_job():
    def all_raise(kit: Kit) -> None:
        kit.hello_all()
        for rank in kit.world.host_of:
            kit.report(rank, "error", "KeyError: 'x'")
    driver, provider, discoverer, _ = make([all_raise], {"a": 2})
    with pytest.raises(JobError, match="every rank of world 0 failed"):
        run(driver, provider, discoverer)


def test_waiting_for_min_slots_times_out_with_what_is_there():
    driver, provider, discoverer, _ = make([finishes], {"a": 1}, elastic_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(JobError, match=r"timeout: need 2, have 1 \(available: a:1\)"):
        run(driver, provider, discoverer)
    assert 0.3 <= time.monotonic() - started < 5 and provider.worlds == []


def test_waiting_for_min_slots_goes_on_when_a_host_joins():
    driver, provider, discoverer, discovery = make([finishes], {"a": 1})
    discovery.hosts["b"] = 1   # seen at the discoverer's next run, within a second
    assert run(driver, provider, discoverer) == ["w0r0", "w0r1"]
    assert provider.worlds[0].placement == [("a", 1), ("b", 1)]


def test_hosts_updated_tells_rank_0_and_the_next_world_starts_at_the_new_size():
    def grows(kit: Kit):
        if kit.world.handle["polls"] == 1:
            kit.hello_all()
            kit.provider.discovery.hosts["b"] = 2   # a host joins while the world runs
            return False
        coordinator = kit.provider.members[(kit.world.index, 0)]
        if not coordinator.sent:
            return False
        assert coordinator.sent[0][0] == "hosts_updated"
        assert coordinator.sent[0][2] & int(HostUpdateResult.added)
        for rank in kit.world.host_of:
            kit.report(rank, "interrupt", "hosts changed")
        return True

    said: list[str] = []
    driver, provider, discoverer, discovery = make([grows, finishes], {"a": 2}, said=said,
                                                   max_np=4)
    provider.discovery = discovery
    provider.poll = lambda world, timeout: _replay(world)
    assert run(driver, provider, discoverer) == ["w1r0", "w1r1", "w1r2", "w1r3"]
    assert provider.worlds[1].placement == [("a", 2), ("b", 2)]
    assert not driver.manager.is_blacklisted("a")   # a host update blames nobody
    assert any("world 0 ended: the hosts changed" in m for m in said), said


def _replay(world: WorldRecord) -> bool:
    """Poll that runs the world's script at every look until it says the world ended."""
    handle = world.handle
    handle["polls"] += 1
    if not handle["ended"]:
        time.sleep(0.05)
        handle["ended"] = handle["script"](handle["kit"]) is not False
    return handle["ended"]


def test_worlds_that_cannot_start_are_retried_a_few_times():
    def cannot_start(kit: Kit) -> None:
        raise AssertionError("never run")

    driver, provider, discoverer, _ = make([cannot_start] * 10, {"a": 2})
    provider.start = lambda world, env: (_ for _ in ()).throw(WorldStartError("node gone"))
    with pytest.raises(JobError, match=f"{drivermod.START_ATTEMPTS + 1} worlds in a row could "
                                       f"not start; the last: world 3 could not start: node "
                                       f"gone"):
        run(driver, provider, discoverer)


def test_a_world_is_placed_on_what_discovery_says_now_not_at_its_last_run():
    # Ray's discovery can lag behind a node's death; a world placed from the periodic answer
    # would be started on the dead node again and again.
    driver, provider, discoverer, discovery = make([finishes], {"a": 2, "b": 2}, max_np=4)
    del discovery.hosts["b"]   # the discoverer (not started here) last saw b
    assert driver.wait_for_slots(discoverer, 2) == [("a", 2)]


def test_a_signal_stops_a_world_that_ignores_every_stop_without_waiting_forever(monkeypatch):
    """_stop_for_signal: a polite stop, then one hard stop, then it gives up on a world that
    never ends (rather than killing it again on every poll, forever)."""
    import threading
    monkeypatch.setattr(drivermod, "KILL_GRACE", 0.05)
    driver, provider, discoverer, _ = make([finishes], {"a": 2})
    discoverer.stop()
    world = WorldRecord(index=0, placement=[("a", 2)], host_of={0: "a", 1: "a"}, started=0.0)
    provider.poll = lambda world, timeout: False   # never ends, whatever it is told
    provider.stop = lambda world, hard, signum=None: provider.stopped.append((world.index,
                                                                              hard))
    driver.signals.append(15)
    ends = []
    stopper = threading.Thread(target=lambda: ends.append(driver._stop_for_signal(world)),
                               daemon=True)
    stopper.start()
    stopper.join(20)
    assert not stopper.is_alive(), "the driver waits forever for a world that never ends"
    [end] = ends
    assert provider.stopped == [(0, False), (0, True)]
    assert (end.kind, end.status) == ("stopped", 128 + 15)
