"""Horovod's elastic ``RayExecutor`` (``min_workers``/``max_workers``): an elastic job whose
worlds are Ray actors.

The same model as ``hvdlite run``'s elastic driver (:mod:`hvdlite.runner.elastic.driver`),
with Ray in place of ``mpiexec`` and the discovery script:

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
  starts from it, so a drained node's work is kept before the node goes.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import queue
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hvdlite.common.core import HorovodInternalError
from hvdlite.common.core import elastic_wire as wire
from hvdlite.runner.elastic import hosts as hostmod
from hvdlite.runner.elastic.driver import RESET_LIMIT_MESSAGE
from hvdlite.runner.elastic.server import Event, Member, Server

from . import formation
from .actors import Group, Worker, visible_devices
from hvdlite.common.core import MpiWorld, WorldError

log = logging.getLogger("hvdlite.ray")

DISCOVER_SECONDS = 1.0   # as hvdlite run's driver (and horovodrun)
TEARDOWN_GRACE = 5.0     # after a failure, how long the other workers get to report and end
ABANDON_SECONDS = 60.0   # after killing a world's actors, how long Ray may take to confirm it
POLL_SECONDS = 0.1
START_ATTEMPTS = 3       # worlds in a row that fail to start before the job gives up


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
    return {wire.DRIVER_VARIABLE: f"{ray.util.get_node_ip_address()}:{server.port}",
            wire.KEY_VARIABLE: server.key.hex(), wire.WORLD_VARIABLE: str(world)}


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
class _World:
    index: int
    placement: List[Tuple[str, int]]          # (node id, workers), in assignment order
    actors: list                              # in world-rank order
    node_of: List[str]                        # each rank's node id
    mpi: Optional[MpiWorld] = None
    pending: Dict[Any, int] = dataclasses.field(default_factory=dict)   # ref -> rank
    results: Dict[int, Any] = dataclasses.field(default_factory=dict)
    died: Dict[int, Optional[RayError]] = dataclasses.field(default_factory=dict)   # ended
    raised: Dict[int, RayTaskError] = dataclasses.field(default_factory=dict)
    members: Dict[int, Member] = dataclasses.field(default_factory=dict)
    lost: List[int] = dataclasses.field(default_factory=list)   # ended without a word
    failed_at: Optional[float] = None
    notified: Optional[list] = None
    killed_at: Optional[float] = None

    @property
    def size(self) -> int:
        return len(self.actors)

    def describe(self, addresses: Dict[str, str]) -> str:
        return ",".join(f"{addresses.get(n, n[:8])}[{n[:8]}]:{k}" for n, k in self.placement)


@dataclasses.dataclass
class _End:
    kind: str                  # "done", "reset" or "failed"
    culprits: List[int]
    reason: str
    results: Optional[List[Any]] = None
    error: Optional[BaseException] = None


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
        self.manager = hostmod.HostManager(self.cooldown_range)
        self.started = False
        self._world: Optional[_World] = None
        self._timestamp = 0
        self._executable: tuple = (None, None, None)
        self._env: Dict[str, str] = {}

    # --- the executor's calls --------------------------------------------------------------
    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None) -> None:
        """Wait (up to ``elastic_timeout``) until the cluster can hold ``min_workers``
        workers, and keep what every world's workers are started with."""
        self._wait_for_slots(self.min_workers)
        self._executable = (executable_cls, executable_args, executable_kwargs)
        self._env = {k: str(v) for k, v in (extra_env_vars or {}).items()}
        self.started = True

    def run(self, worker_fn: Callable[[Any], Any]) -> List[Any]:
        """Run ``worker_fn(executable)`` on every worker of a sequence of worlds until one
        finishes; its workers' return values in rank order."""
        if not self.started:
            raise RuntimeError("RayExecutor.run(): call start() first.")
        # One commit server per run: a run's commits never resume another run's function.
        server = commit_server()
        try:
            return self._loop(server, worker_fn)
        finally:
            if self._world is not None:
                self._end_world(self._world, server, failed=True)
            server.close()

    def shutdown(self) -> None:
        self.started = False

    # --- the worlds --------------------------------------------------------------------------
    def _loop(self, server: Server, worker_fn: Callable) -> List[Any]:
        resets = start_failures = 0
        index = 0
        while True:
            placement = self._wait_for_slots(self.min_workers)
            try:
                world = self._start_world(server, index, placement, worker_fn)
            except (WorldError, RayError) as exc:   # nodes gone while starting, ...
                if self._world is not None:
                    self._end_world(self._world, server, failed=True)
                start_failures += 1
                if start_failures > START_ATTEMPTS:
                    raise ElasticRayError(f"{start_failures} worlds in a row could not start; "
                                          f"the last: {exc}") from exc
                end = _End("reset", [], f"world {index} could not start: {exc}")
                world = None
            else:
                start_failures = 0
                end = self._watch(server, world)
                self._end_world(world, server, failed=end.kind != "done")
            if end.kind == "done":
                return end.results
            if end.kind == "failed":
                raise ElasticRayError(end.reason) from end.error
            blamed = sorted({world.node_of[r] for r in end.culprits}) if world else []
            note = ""
            if self.cooldown_range is not None and blamed:
                for node in blamed:
                    self.manager.blacklist(node)
                note = f"; set aside {', '.join(self._name(n) for n in blamed)} for a cooldown"
            log.warning("hvdlite.ray: elastic: world %d ended: %s%s", index, end.reason, note)
            if self.reset_limit is not None and resets >= self.reset_limit:
                raise ElasticRayError(RESET_LIMIT_MESSAGE.format(self.reset_limit))
            resets += 1
            index += 1

    def _name(self, node: str) -> str:
        return f"node {node[:8]} ({self._address(node)})"

    def _address(self, node: str) -> str:
        return getattr(self.discovery, "addresses", {}).get(node, node)

    def _refresh(self) -> int:
        return int(self.manager.update(self.discovery.find_available_hosts_and_slots()))

    def _wait_for_slots(self, need: int) -> List[Tuple[str, int]]:
        deadline = time.monotonic() + self.elastic_timeout
        said = False
        while True:
            self._refresh()
            available = self.manager.available()
            if sum(slots for _, slots in available) >= need:
                return hostmod.assign(available, self.max_workers)
            if time.monotonic() > deadline:
                raise ElasticRayError(
                    f"waited {self.elastic_timeout:g} s (elastic_timeout) for room for {need} "
                    f"workers (min_workers) of {self.cpus_per_worker} CPU"
                    + (f" and {self.gpus_per_worker} GPU" if self.use_gpu else "")
                    + f" each, but the Ray cluster's nodes hold only "
                    f"{sum(s for _, s in available)}: {self.manager.describe()}. Add nodes (or "
                    f"let the autoscaler), or lower min_workers.")
            if not said:
                log.warning("hvdlite.ray: elastic: waiting up to %g s for room for %d "
                            "workers; %s", self.elastic_timeout, need, self.manager.describe())
                said = True
            time.sleep(0.2)

    def _start_world(self, server: Server, index: int, placement: List[Tuple[str, int]],
                     worker_fn: Callable) -> _World:
        # MPI numbers each host's ranks consecutively: order the nodes by address so that
        # nodes sharing one (several Ray nodes on one machine) stay together.
        ordered = sorted(placement, key=lambda p: self._address(p[0]))
        remote = ray.remote(Worker)
        gpus = self.gpus_per_worker * int(self.use_gpu)
        actors, node_of = [], []
        for node, count in ordered:
            for _ in range(count):
                node_of.append(node)
                actors.append(remote.options(
                    num_cpus=self.cpus_per_worker, num_gpus=gpus,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote())
        world = _World(index, list(placement), actors, node_of)
        self._world = world
        timeout = self.settings.timeout_s
        env = {**self._env, **worker_environment(server, index)}
        calls = [a.update_env_vars.remote(env) for a in actors]
        if self.use_gpu:
            ids = formation.get_bounded([a.get_gpu_ids.remote() for a in actors], timeout,
                                        "report their GPUs")
            calls += visible_devices(actors, node_of, ids)
        formation.get_bounded(calls, timeout, "start and set their environment")
        log.info("hvdlite.ray: elastic: world %d: %d worker(s) on %s", index, len(actors),
                 world.describe(getattr(self.discovery, "addresses", {})))
        world.mpi = formation.form_world(Group(actors), len(actors), timeout)
        formation.get_bounded([a.start_executable.remote(*self._executable) for a in actors],
                              timeout, "create their executable")
        world.pending = {a.execute.remote(worker_fn): rank for rank, a in enumerate(actors)}
        return world

    def _watch(self, server: Server, world: _World) -> _End:
        last_discovery = time.monotonic()
        while world.pending:
            ready, _ = ray.wait(list(world.pending), num_returns=1, timeout=POLL_SECONDS)
            for ref in ready:
                self._collect(world, ref)
            self._handle_events(server, world)
            now = time.monotonic()
            if now - last_discovery >= DISCOVER_SECONDS and world.failed_at is None:
                last_discovery = now
                self._refresh()
                self._maybe_notify(world)
            if (world.failed_at is not None and world.killed_at is None
                    and now - world.failed_at > TEARDOWN_GRACE):
                self._kill(world)   # the rest of the world: its refs then end with errors
            if world.killed_at is not None and now - world.killed_at > ABANDON_SECONDS:
                # Ray has not confirmed these actors' end (their node unreachable but not yet
                # declared dead): count them as lost rather than wait on.
                log.warning("hvdlite.ray: elastic: world %d: Ray did not confirm the end of "
                            "rank(s) %s within %g s; counting them as lost", world.index,
                            sorted(world.pending.values()), ABANDON_SECONDS)
                for rank in world.pending.values():
                    world.died[rank] = None
                world.pending.clear()
        self._handle_events(server, world)
        return self._classify(world)

    def _collect(self, world: _World, ref) -> None:
        rank = world.pending.pop(ref)
        try:
            world.results[rank] = ray.get(ref)
            return
        except RayActorError as exc:   # its process ended: a reset's exit, killed, node lost
            world.died[rank] = exc
        except RayTaskError as exc:    # the function raised
            world.raised[rank] = exc
            # Its process lives on in a world that cannot go on: end it, so that the others
            # notice (hvdlite's watchdog) and hand in their commits.
            ray.kill(world.actors[rank], no_restart=True)
        if world.failed_at is None:
            world.failed_at = time.monotonic()

    def _handle_events(self, server: Server, world: _World) -> None:
        while True:
            try:
                event: Event = server.events.get_nowait()
            except queue.Empty:
                return
            member = event.member
            if member.world != world.index:
                continue   # a worker of an earlier world, ending late
            if event.kind == "hello":
                world.members[member.rank] = member
                if member.rank == 0:
                    world.notified = None   # (re)connected: tell it again if needed
            elif event.kind == "outcome":
                if member.outcome[0] in ("reset", "error") and world.failed_at is None:
                    world.failed_at = event.at
            elif event.kind == "ended" and member.outcome is None:
                world.lost.append(member.rank)
                if world.failed_at is None:
                    world.failed_at = event.at

    def _maybe_notify(self, world: _World) -> None:
        """Tell rank 0 when the nodes available now would place the workers differently
        (a node joined, left, or is being drained)."""
        desired = hostmod.desired_placement(self.manager.available(), self.min_workers,
                                            self.max_workers)
        if desired == world.placement or desired == world.notified:
            return
        coordinator = world.members.get(0)
        if coordinator is None:
            return
        self._timestamp += 1
        update = int(wire.HostUpdateResult.mixed)
        if coordinator.send(("hosts_updated", self._timestamp, update)):
            world.notified = desired
            drained = [self._name(n) for n, _ in world.placement
                       if n in getattr(self.discovery, "drained", {})]
            log.warning("hvdlite.ray: elastic: world %d: the nodes changed%s; the workers "
                        "stop at their next commit", world.index,
                        f" ({', '.join(drained)} being drained)" if drained else "")

    def _classify(self, world: _World) -> _End:
        outcomes = {r: m.outcome for r, m in world.members.items() if m.outcome}
        kinds = {o[0] for o in outcomes.values()}
        if len(world.results) == world.size or ("done" in kinds and world.results):
            return _End("done", [], "training finished",
                        results=[world.results[r] for r in sorted(world.results)])
        # An exception from the function itself (not the collective failure a lost worker
        # causes) ends the job with it, as a failing train function ends a Ray Train run: a
        # bug would fail again in every world.
        errors = [r for r, exc in sorted(world.raised.items())
                  if not isinstance(getattr(exc, "cause", None), HorovodInternalError)]
        if errors:
            exc = world.raised[errors[0]]
            cause = getattr(exc, "cause", None) or exc
            text = str(cause).strip().splitlines()
            return _End("failed", errors, f"rank {errors[0]} on "
                        f"{self._name(world.node_of[errors[0]])} raised "
                        f"{type(cause).__name__}: {text[-1][:300] if text else ''}",
                        error=cause)
        # Who failed on their own: the first worker whose process ended without a word
        # (those after it went down with the world).
        silent = [r for r in world.died if r not in outcomes]
        lost = [r for r in world.lost if r in silent] + [r for r in silent
                                                         if r not in world.lost]
        resets = [(r, o[1]) for r, o in outcomes.items() if o[0] == "reset"]
        if lost:
            rank = lost[0]
            return _End("reset", [rank], f"rank {rank} on {self._name(world.node_of[rank])} "
                        f"ended without a word (killed, crashed, or its node lost)")
        if resets:
            return _End("reset", [], f"rank {resets[0][0]}: "
                        f"{resets[0][1].splitlines()[-1][:300]}")
        if "interrupt" in kinds:
            return _End("reset", [], "the nodes changed")
        rank = min(world.raised) if world.raised else 0
        cause = getattr(world.raised.get(rank), "cause", None)
        return _End("failed", [], f"world {world.index} failed with no worker lost: rank "
                    f"{rank} raised {cause!r}", error=cause)

    def _kill(self, world: _World) -> None:
        if world.killed_at is None:
            world.killed_at = time.monotonic()
        for actor in world.actors:
            ray.kill(actor, no_restart=True)

    def _end_world(self, world: _World, server: Server, failed: bool) -> None:
        """End the world's actors and launcher processes (after a clean end, the workers
        release their proxies first)."""
        self._world = None
        if failed:
            self._kill(world)
        if world.mpi is not None:
            formation.end_world(None if failed else Group(world.actors), world.mpi,
                                self.settings.timeout_s)
        if not failed:
            self._kill(world)
        server.forget(world.index)


# --- Horovod's older API ---------------------------------------------------------------------
@dataclasses.dataclass
class ElasticSettings:
    """What :meth:`ElasticRayExecutor.create_settings` returns: the fields of Horovod's
    ``ElasticSettings`` that apply here (``discovery`` is set by the executor)."""
    min_num_proc: int = 1
    max_num_proc: Optional[int] = None
    reset_limit: Optional[int] = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    ssh_identity_file: Optional[str] = None
    nics: Optional[set] = None
    cooldown_range: Optional[Tuple[float, float]] = None
    verbose: int = 1
    discovery: Any = None


class ElasticRayExecutor:
    """Horovod's ``horovod.ray.ElasticRayExecutor`` (deprecated there since 0.25 in favour of
    ``RayExecutor(min_workers=...)``), for scripts that still use it: the same elastic job as
    :class:`hvdlite.ray.RayExecutor` with ``min_workers``.

    Args:
        settings: from :meth:`create_settings`.
        use_gpu: give each worker (slot) GPUs.
        cpus_per_slot: each worker's CPUs.
        gpus_per_slot: each worker's GPUs (``use_gpu`` only; default 1).
        env_vars: environment variables set in every worker before it runs the function.
        override_discovery: find the nodes through Ray (True), or use ``settings.discovery``.
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                        reset_limit: Optional[int] = None, elastic_timeout: float = 600,
                        timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        nics: Optional[set] = None, min_np: Optional[int] = None,
                        max_np: Optional[int] = None, **kwargs: Any) -> ElasticSettings:
        """Horovod's settings; ``min_np``/``max_np`` are its deprecated spellings, and of its
        other keyword arguments ``cooldown_range`` and ``verbose`` apply."""
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            max_num_proc = max_np
        unknown = sorted(set(kwargs) - {"cooldown_range", "verbose"})
        if unknown:
            raise TypeError(f"ElasticRayExecutor.create_settings(): unexpected keyword "
                            f"argument(s) {unknown}")
        return ElasticSettings(min_num_proc=min_num_proc, max_num_proc=max_num_proc,
                               reset_limit=reset_limit, elastic_timeout=elastic_timeout,
                               timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                               nics=nics, **kwargs)

    def __init__(self, settings: ElasticSettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: Optional[float] = None,
                 env_vars: Optional[Dict[str, Any]] = None,
                 override_discovery: bool = True) -> None:
        if gpus_per_slot and not use_gpu:   # Horovod's checks and messages
            raise ValueError("gpus_per_slot is set, but use_gpu is False. use_gpu must be True "
                             "if gpus_per_slot is set. ")
        gpus_per_slot = gpus_per_slot or int(use_gpu)
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"gpus_per_slot must be >= 1: Got {gpus_per_slot}.")
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self.env_vars = env_vars or {}
        self._adapter = ElasticAdapter(
            settings, min_workers=settings.min_num_proc, max_workers=settings.max_num_proc,
            use_gpu=use_gpu, cpus_per_worker=cpus_per_slot,
            gpus_per_worker=gpus_per_slot or None, override_discovery=override_discovery,
            reset_limit=settings.reset_limit, cooldown_range=settings.cooldown_range,
            elastic_timeout=settings.elastic_timeout)

    def start(self) -> None:
        """Wait (up to ``elastic_timeout``) until the cluster has room for ``min_num_proc``
        workers."""
        self._adapter.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any],
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``worker_fn()`` (an ``hvd.elastic.run`` training function) on every worker of a
        sequence of worlds until one finishes; that world's return values in rank order.
        ``callbacks`` are accepted and not called (see docs/deviations.md)."""
        return self._adapter.run(lambda _: worker_fn())
