"""Horovod's elastic ``RayExecutor`` (``min_workers``/``max_workers``): an elastic job whose
worlds are Ray actors.

The elastic driver of ``hvdlite run`` (:mod:`hvdlite.runner.elastic.driver`: the same loop,
rules and messages) with :class:`RayProvider` in place of ``mpiexec`` and the discovery script:

* the hosts are the Ray cluster's nodes that are alive and not being drained, each offering
  ``CPU // cpus_per_worker`` workers (and ``GPU // gpus_per_worker`` with ``use_gpu``), as
  Horovod's ``RayHostDiscovery`` counts them;
* each world is new actors pinned to the chosen nodes, made one MPI world
  (:mod:`hvdlite.ray.formation`), running the function, which uses ``hvd.elastic.run``; the
  workers connect to this process's commit server (:class:`~hvdlite.runner.elastic.server.Server`)
  at ``hvd.init()``, and rank 0 ships its commits there;
* a worker that dies (its actor, process or node lost) is noticed by the others through
  hvdlite's watchdog; they hand in the newest commit and end; the world's actors are killed,
  and the next world starts on what the cluster offers, its rank 0 resuming from the commit;
* a node that joins, leaves, or is being drained (Ray's notice of a preemption or a
  scale-down) changes the placement: rank 0 is told, every rank stops at its next
  ``state.commit()`` (``HostsUpdatedInterrupt``) with rank 0's state shipped, and the next world
  starts from it, so a drained node's work is kept before the node goes;
* the function raising on its own (not the collective failure a lost worker causes) ends the
  job with its exception, as a failing train function ends a Ray Train run; a failing node is
  blacklisted only with a ``cooldown_range``.

Horovod's older ``ElasticRayExecutor`` is in :mod:`.elastic_executor`.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hvdlite.common.core import HorovodInternalError
from hvdlite.common.core import elastic_wire as wire
from hvdlite.runner.elastic import hosts as hostmod
from hvdlite.runner.elastic.driver import Discoverer, ElasticDriver, last_line
from hvdlite.runner.elastic.driver import driver_variable, worker_environment as driver_environment
from hvdlite.runner.elastic.options import ElasticSettings as DriverSettings
from hvdlite.runner.elastic.provider import WorldRecord, WorldStartError, ranks_on
from hvdlite.runner.elastic.server import Server

from . import formation
from .actors import Group, Worker, visible_devices
from hvdlite.common.core import MpiWorld, WorldError

log = logging.getLogger("hvdlite.ray")

DISCOVER_SECONDS = 1.0   # as hvdlite run's driver (and horovodrun)
REPORT_GRACE = 5.0       # after a world's actors ended, how long their reports may take
ABANDON_SECONDS = 60.0   # after killing a world's actors, how long Ray may take to confirm it


class ElasticRayError(RuntimeError):
    """The elastic Ray job cannot go on; the message says why."""


_drain_warned = False


def draining_nodes() -> Dict[str, int]:
    """The nodes Ray is draining (a preemption or scale-down notice): node id -> deadline in
    ms since the epoch (0: none).  Ray has no public call for this yet; Ray Train and Ray Data
    read it the same way.  If it fails, drains are not seen (said once in the log) and a
    drained node's workers are lost with the node, as without a notice."""
    global _drain_warned
    try:
        return dict(ray._private.state.state.get_draining_nodes() or {})
    except Exception as exc:   # noqa: BLE001 - a Ray without the call: work on without notices
        if not _drain_warned:
            log.warning("hvdlite.ray: cannot read Ray's draining nodes (%s); preemption "
                        "notices will not be acted on", exc)
            _drain_warned = True
        return {}


def commit_server(report_events: bool = True) -> Server:
    """A commit server (``hvdlite run``'s elastic driver's) for the workers of this Ray job,
    listening on this node's Ray address when that is a loopback one, else everywhere."""
    address = ray.util.get_node_ip_address()
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = False
    # (a node on 127.0.2.1 is reached there, not on 127.0.0.1)
    return Server(address if loopback else "0.0.0.0", report_events=report_events)


def worker_environment(server: Server, world: int) -> Dict[str, str]:
    """The variables that connect world ``world``'s workers to ``server`` at ``hvd.init()``."""
    return driver_environment(server, world, ray.util.get_node_ip_address())


def stop_at_next_commit(server: Server, world: int,
                        update: wire.HostUpdateResult) -> bool:
    """Tell world ``world``'s rank 0 that the hosts changed, when it runs an
    ``hvd.elastic.run`` function and has not reported an end: every rank then stops at its
    next ``state.commit()`` with rank 0's state shipped.  Whether it was told."""
    coordinator = server.world_members(world).get(0)
    if coordinator is None or not coordinator.in_session or coordinator.outcome is not None:
        return False
    return coordinator.send(("hosts_updated", 1, int(update)))


class DrainWatcher(threading.Thread):
    """Watches for Ray draining a node of one world (a preemption notice) and then tells the
    world's rank 0, through the commit server, that the hosts changed: every rank stops at its
    next ``state.commit()`` with rank 0's state shipped (``HostsUpdatedInterrupt``), before
    the node goes.  For worlds whose size someone else decides (Ray Train)."""

    def __init__(self, server: Server, world: int, nodes: Sequence[str],
                 period_s: float = DISCOVER_SECONDS) -> None:
        super().__init__(name=f"hvdlite-ray-drain-watch-{world}", daemon=True)
        self.server, self.world, self.nodes = server, world, set(nodes)
        self.period_s = period_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            drained = sorted(self.nodes & set(draining_nodes()))
            if not drained:
                continue
            if stop_at_next_commit(self.server, self.world, wire.HostUpdateResult.removed):
                log.warning("hvdlite.ray: Ray is draining node(s) %s of world %d (a "
                            "preemption notice): the workers stop at their next commit",
                            ", ".join(n[:8] for n in drained), self.world)
                return

    def stop(self) -> None:
        self._stop_event.set()


class RayHostDiscovery:
    """The Ray nodes that can hold workers now: alive, not being drained; each with the
    number of workers its resources hold (Horovod's ``RayHostDiscovery``)."""

    def __init__(self, use_gpu: bool = False, cpus_per_worker: float = 1,
                 gpus_per_worker: float = 1) -> None:
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.addresses: Dict[str, str] = {}   # node id -> its IP address
        self.drained: Dict[str, int] = {}     # node id -> deadline (ms), at the last look

    def describe(self) -> str:
        return "the Ray cluster's nodes"

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        self.drained = draining_nodes()
        found: Dict[str, int] = {}
        for node in ray.nodes():
            node_id = node["NodeID"]
            if not node.get("Alive") or node_id in self.drained:
                continue
            resources = node.get("Resources", {})
            slots = resources.get("CPU", 0) // self.cpus_per_worker if self.cpus_per_worker \
                else math.inf
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // self.gpus_per_worker)
            if slots and slots != math.inf:
                found[node_id] = int(slots)
                self.addresses[node_id] = node["NodeManagerAddress"]
        return found


@dataclasses.dataclass
class RayWorld:
    """What :class:`RayProvider` holds of one world (``WorldRecord.handle``)."""
    actors: list                              # in world-rank order
    mpi: Optional[MpiWorld] = None
    pending: Dict[Any, int] = dataclasses.field(default_factory=dict)   # ref -> rank
    killed_at: Optional[float] = None


class RayProvider:
    """Each world as new Ray actors, one MPI world (the elastic driver's provider; see the
    module docstring)."""

    host_word = "node"
    retries_own_errors = False   # a bug would fail again in every world, as in Ray Train
    report_grace = REPORT_GRACE

    def __init__(self, adapter: "ElasticAdapter", worker_fn: Callable, server: Server) -> None:
        self.adapter = adapter
        self.worker_fn = worker_fn
        self.server = server
        # Without a cooldown a failing node is not set aside at all: on Ray a node that is
        # gone is gone from discovery too, and one that is not would be lost for good.
        self.blacklists = adapter.cooldown_range is not None

    def host_name(self, node: str) -> str:
        return f"node {node[:8]} ({self.address(node)})"

    def address(self, node: str) -> str:
        return getattr(self.adapter.discovery, "addresses", {}).get(node, node)

    def start(self, world: WorldRecord, env: Dict[str, str]) -> None:
        try:
            self._start(world, env)
        except (WorldError, RayError) as exc:   # nodes gone while starting, ...
            raise WorldStartError(str(exc)) from exc

    def _start(self, world: WorldRecord, env: Dict[str, str]) -> None:
        adapter = self.adapter
        # MPI numbers each host's ranks consecutively: order the nodes by address so that
        # nodes sharing one (several Ray nodes on one machine) stay together.
        ordered = sorted(world.placement, key=lambda p: self.address(p[0]))
        world.host_of = ranks_on(ordered)
        remote = ray.remote(Worker)
        gpus = adapter.gpus_per_worker * int(adapter.use_gpu)
        actors = [remote.options(
            num_cpus=adapter.cpus_per_worker, num_gpus=gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(world.host_of[rank], soft=False)
        ).remote() for rank in range(world.size)]
        world.handle = handle = RayWorld(actors)
        timeout = adapter.settings.timeout_s
        env = {**adapter.env, **env,
               **driver_variable(self.server, ray.util.get_node_ip_address())}
        calls = [a.update_env_vars.remote(env) for a in actors]
        node_of = [world.host_of[rank] for rank in range(world.size)]
        if adapter.use_gpu:
            ids = formation.get_bounded([a.get_gpu_ids.remote() for a in actors], timeout,
                                        "report their GPUs")
            calls += visible_devices(actors, node_of, ids)
        formation.get_bounded(calls, timeout, "start and set their environment")
        log.info("hvdlite.ray: elastic: world %d: %d worker(s) on %s", world.index, len(actors),
                 ",".join(f"{self.host_name(n)}:{k}" for n, k in ordered))
        handle.mpi = formation.form_world(Group(actors), len(actors), timeout)
        formation.get_bounded([a.start_executable.remote(*adapter.executable) for a in actors],
                              timeout, "create their executable")
        handle.pending = {a.execute.remote(self.worker_fn): rank
                          for rank, a in enumerate(actors)}

    def poll(self, world: WorldRecord, timeout: float) -> bool:
        handle: RayWorld = world.handle
        if handle.pending:
            ready, _ = ray.wait(list(handle.pending), num_returns=1, timeout=timeout)
            for ref in ready:
                self._collect(world, ref)
        if handle.killed_at is not None and handle.pending and (
                time.monotonic() - handle.killed_at > ABANDON_SECONDS):
            # Ray has not confirmed these actors' end (their node unreachable but not yet
            # declared dead): count them as lost rather than wait on.
            log.warning("hvdlite.ray: elastic: world %d: Ray did not confirm the end of "
                        "rank(s) %s within %g s; counting them as lost", world.index,
                        sorted(handle.pending.values()), ABANDON_SECONDS)
            world.died.extend(sorted(handle.pending.values()))
            handle.pending.clear()
        return not handle.pending

    def _collect(self, world: WorldRecord, ref: Any) -> None:
        handle: RayWorld = world.handle
        rank = handle.pending.pop(ref)
        try:
            world.results[rank] = ray.get(ref)
            return
        except RayActorError:   # its process ended: a reset's exit, killed, node lost
            world.died.append(rank)
        except RayTaskError as exc:    # the function raised
            if isinstance(getattr(exc, "cause", None), HorovodInternalError):
                world.died.append(rank)   # the collective failure a lost worker causes
            else:
                world.raised[rank] = exc
            # Its process lives on in a world that cannot go on: end it, so that the others
            # notice (hvdlite's watchdog) and hand in their commits.
            ray.kill(handle.actors[rank], no_restart=True)
        if world.failed_at is None:
            world.failed_at = time.monotonic()

    def stop(self, world: WorldRecord, hard: bool, signum: Optional[int] = None) -> None:
        handle: RayWorld = world.handle
        if handle.killed_at is None:   # killed is as hard as it gets: once is enough
            self._kill(handle)

    @staticmethod
    def _kill(handle: RayWorld) -> None:
        if handle.killed_at is None:
            handle.killed_at = time.monotonic()
        for actor in handle.actors:   # the world's refs then end with errors
            ray.kill(actor, no_restart=True)

    def settle(self, world: WorldRecord) -> None:
        pass   # nothing outlives the world's end but its workers' reports

    def finish(self, world: WorldRecord, failed: bool) -> None:
        """End the world's actors and launcher processes (after a clean end, the workers
        release their proxies first)."""
        handle: Optional[RayWorld] = world.handle
        if handle is None:
            return
        if failed:
            self._kill(handle)
        if handle.mpi is not None:
            formation.end_world(None if failed else Group(handle.actors), handle.mpi,
                                self.adapter.settings.timeout_s)
        if not failed:
            self._kill(handle)

    def error(self, world: WorldRecord, rank: int) -> BaseException:
        exc = world.raised[rank]
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, BaseException):
            text = f"{type(cause).__name__}: {last_line(cause)}"
        else:   # only its report: "Type: message"
            text, cause = last_line(cause), None
        error = ElasticRayError(f"rank {rank} on {self.host_name(world.host_of[rank])} "
                                f"raised {text}")
        error.__cause__ = cause
        return error

    def result(self, world: WorldRecord) -> List[Any]:
        return [world.results[r] for r in sorted(world.results)]


def say(message: str) -> None:
    """What the elastic driver tells the user of a Ray job: the log's warnings."""
    log.warning("hvdlite.ray: elastic: %s", message)


class ElasticAdapter:
    """The elastic side of :class:`hvdlite.ray.RayExecutor` (see the module docstring).

    Horovod's ``ElasticAdapter`` arguments; ``cooldown_range`` also decides whether a failing
    node is set aside at all (see docs/ray.md)."""

    def __init__(self, settings: Any, min_workers: int, max_workers: Optional[int] = None,
                 use_gpu: bool = False, cpus_per_worker: float = 1,
                 gpus_per_worker: Optional[float] = None, override_discovery: bool = True,
                 reset_limit: Optional[int] = None,
                 cooldown_range: Optional[Tuple[float, float]] = None,
                 elastic_timeout: float = 600) -> None:
        if not isinstance(min_workers, int) or min_workers < 1:
            raise ValueError(f"RayExecutor(min_workers={min_workers!r}): expected a positive "
                             f"integer.")
        if max_workers is not None and (not isinstance(max_workers, int)
                                        or max_workers < min_workers):
            raise ValueError(f"RayExecutor(max_workers={max_workers!r}): expected an integer "
                             f"no smaller than min_workers={min_workers}.")
        if cooldown_range is not None:
            hostmod.check_cooldown_range(*cooldown_range)
        self.settings = settings
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker or 1
        self.reset_limit = reset_limit
        self.cooldown_range = tuple(cooldown_range) if cooldown_range else None
        self.elastic_timeout = elastic_timeout
        if override_discovery:
            self.discovery = RayHostDiscovery(use_gpu, cpus_per_worker, self.gpus_per_worker)
        else:
            self.discovery = getattr(settings, "discovery", None)
            if self.discovery is None:
                raise ValueError("RayExecutor(override_discovery=False): the settings carry no "
                                 "discovery (settings.discovery with "
                                 "find_available_hosts_and_slots()).")
        # One driver for every run: its blacklist outlives a run, as the adapter's did.
        self.driver = ElasticDriver(None, DriverSettings(
            min_workers, min_workers, max_workers, self.discovery, reset_limit,
            self.cooldown_range, elastic_timeout), say, ElasticRayError, self._timeout_error)
        self.started = False
        self.executable: tuple = (None, None, None)
        self.env: Dict[str, str] = {}

    def _timeout_error(self, need: int, have: int, hosts_text: str) -> ElasticRayError:
        return ElasticRayError(
            f"waited {self.elastic_timeout:g} s (elastic_timeout) for room for {need} "
            f"workers (min_workers) of {self.cpus_per_worker} CPU"
            + (f" and {self.gpus_per_worker} GPU" if self.use_gpu else "")
            + f" each, but the Ray cluster's nodes hold only {have}: {hosts_text}. Add nodes "
            f"(or let the autoscaler), or lower min_workers.")

    # --- the executor's calls --------------------------------------------------------------
    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None) -> None:
        """Wait (up to ``elastic_timeout``) until the cluster can hold ``min_workers``
        workers, and keep what every world's workers are started with."""
        discoverer = Discoverer(self.discovery, say)
        discoverer.start()
        try:
            self.driver.wait_for_slots(discoverer, self.min_workers)
        finally:
            discoverer.stop()
        self.executable = (executable_cls, executable_args, executable_kwargs)
        self.env = {k: str(v) for k, v in (extra_env_vars or {}).items()}
        self.started = True

    def run(self, worker_fn: Callable[[Any], Any]) -> List[Any]:
        """Run ``worker_fn(executable)`` on every worker of a sequence of worlds until one
        finishes; its workers' return values in rank order."""
        if not self.started:
            raise RuntimeError("RayExecutor.run(): call start() first.")
        # One commit server per run: a run's commits never resume another run's function.
        server = commit_server()
        discoverer = Discoverer(self.discovery, say)
        try:
            self.driver.provider = RayProvider(self, worker_fn, server)
            return self.driver.run(server, discoverer)
        finally:
            discoverer.stop()
            server.close()

    def shutdown(self) -> None:
        self.started = False
