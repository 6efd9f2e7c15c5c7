"""Forming one MPI world from the processes that torchrun (or any launcher that follows its
env:// convention: Kubeflow's PyTorchJob, SageMaker, Lightning, ...) started.

Those processes already run the user's script, each with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; no MPI launcher started them.  ``hvd.init()`` makes them one
world with MPICH's manual launch, the formation the Ray integration uses
(:mod:`~hvdlite.common.runtime.hydra_world`): rank 0 runs ``mpiexec -launcher manual`` as its
child, the first process on each host runs that host's proxy, and every process joins as its
rank with the PMI environment its placeholder received.  The few messages this takes travel
through a key-value store at ``MASTER_ADDR:MASTER_PORT``: torchrun's own (its agent serves one
there for its workers, ``TORCHELASTIC_USE_AGENT_STORE``), or one that rank 0 serves for the
time of the formation when no agent does (a PyTorchJob without torchrun).  The store is
PyTorch's ``TCPStore``: env:// is PyTorch's convention, so torch is there.

Why not MPI's dynamic processes (singleton ``MPI_Init`` in every process, then
``Comm_accept``/``Comm_connect`` and ``Intercomm_merge``): the world would not be
``MPI_COMM_WORLD`` (node-local shared memory and everything that assumes one world would see N
singletons merged pairwise), each merge is a collective over the growing world, so forming N
ranks takes N sequential rounds, and MPICH's TCP netmods support it least well.  The manual
launch gives a real ``MPI_COMM_WORLD`` whose host structure is the launcher's, in one round.

Every wait is bounded by ``HVDLITE_START_TIMEOUT`` and names what did not happen; a process
that fails a step posts its error in the store, and every other process raises it at once.
"""
from __future__ import annotations

import atexit
import datetime
import json
import logging
import secrets
import socket
import time
from typing import Optional

from hvdlite.common.runtime import hydra_member
from hvdlite.common.runtime.hydra_world import MpiWorld
from hvdlite.common.runtime.launch_env import Launch
from hvdlite.common.runtime.store_commits import StoreChannel, world_number

log = logging.getLogger("hvdlite")

POLL_SECONDS = 0.05
_world: Optional[MpiWorld] = None   # rank 0's mpiexec, kept for the process's life
# Under torchrun's agent store: where hvd.elastic keeps its commits (see store_commits).
commit_channel: Optional[StoreChannel] = None


class FormationError(RuntimeError):
    """The processes of an env:// launch could not form one world (the message says why)."""


def torchrun_attempt(environ) -> tuple[str, int]:
    """torchrun's run id and restart count (``("env", 0)`` without torchrun)."""
    run = environ.get("TORCHELASTIC_RUN_ID", "").strip() or "env"
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    return run, int(attempt) if attempt.isdigit() else 0


def store_prefix(environ) -> str:
    """Keys of one world: torchrun's run id and restart count keep the worlds of its restarts
    (and of other runs on the same store) apart."""
    run, attempt = torchrun_attempt(environ)
    return f"hvdlite/world/{run}/{attempt}"


def rank_order(hosts: list[str]) -> tuple[list[tuple[str, int]], list[int]]:
    """Given each rank's host, the world's host segments (hosts in order of their lowest rank,
    with their rank counts) and each rank's MPI rank in the manually launched world (Hydra
    numbers ranks host after host).  Pure logic, unit-tested."""
    first = {host: index for index, host in enumerate(dict.fromkeys(hosts))}
    order = sorted(range(len(hosts)), key=lambda r: (first[hosts[r]], r))
    mpi_rank = [0] * len(hosts)
    for position, rank in enumerate(order):
        mpi_rank[rank] = position
    segments = [(host, hosts.count(host)) for host in first]
    return segments, mpi_rank


def control_address(master_addr: str) -> str:
    """The address under which the other hosts' proxies reach rank 0's ``mpiexec``: the
    rendezvous address when rank 0 runs on that host, else this host's address on the route to
    it (the interface the other hosts reached the rendezvous through)."""
    try:
        target = socket.gethostbyname(master_addr)
    except OSError:
        return socket.gethostname()
    if target.startswith("127.") or master_addr in (socket.gethostname(), socket.getfqdn()):
        return master_addr
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, 9))   # a UDP connect sends nothing
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostname()


class _Rendezvous:
    """The store of one formation, with bounded waits that stop at the first posted error."""

    def __init__(self, launch: Launch, environ, timeout_s: float) -> None:
        try:
            from torch.distributed import PrefixStore, TCPStore
        except ImportError:
            raise FormationError(
                f"this process was started by {launch.describe()}; forming the world of an "
                f"env:// launch needs PyTorch's TCPStore, and torch is not installed. Install "
                f"torch, or launch with `hvdlite run` / mpiexec instead.") from None
        self.addr = environ.get("MASTER_ADDR", "").strip()
        port = environ.get("MASTER_PORT", "").strip()
        if not self.addr or not port.isdigit():
            raise FormationError(
                f"this process was started by {launch.describe()} but MASTER_ADDR and "
                f"MASTER_PORT are not both set (got {self.addr!r}, {port!r}); hvd.init() needs "
                f"them to find the other processes (torchrun sets them).")
        self.port, self.timeout_s, self.rank = int(port), timeout_s, launch.rank
        agent = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"
        # Without an agent's store, rank 0 serves one, for the formation only.
        self.agent = agent
        self.serving = not agent and launch.rank == 0
        try:
            store = TCPStore(self.addr, self.port, None, self.serving,
                             datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds for one cause
            role = "serve the rendezvous on" if self.serving else "reach the rendezvous at"
            raise FormationError(
                f"rank {launch.rank} could not {role} MASTER_ADDR:MASTER_PORT = "
                f"{self.addr}:{self.port} within {timeout_s:g} s: {exc}") from None
        self.raw = store
        self.store = PrefixStore(store_prefix(environ), store)

    def post(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def take(self, key: str):
        """Read ``key`` and delete it (an arrival is consumed by the formation it joins)."""
        value = json.loads(self.store.get(key))
        self.store.delete_key(key)
        return value

    def fail(self, generation: Optional[int], message: str) -> None:
        """Post this process's error for the others of ``generation`` (None: before there is
        one; only rank 0 is in a formation then, and it says so in the plan)."""
        if generation is None:
            return
        try:
            self.post(f"g{generation}/error", f"rank {self.rank}: {message}")
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass

    def wait(self, ready, what: str, generation: Optional[int] = None, detail=None):
        """``ready()``'s first value that is not None; FormationError when another process of
        ``generation`` posted an error, or when ``timeout_s`` passes (with ``detail()``)."""
        deadline = time.monotonic() + self.timeout_s
        error_key = f"g{generation}/error"
        while True:
            if generation is not None and self.store.check([error_key]):
                raise FormationError(f"forming the world failed on another process: "
                                     f"{json.loads(self.store.get(error_key))}")
            try:
                value = ready()
            except Exception as exc:  # noqa: BLE001 - torch's store raises several kinds
                raise FormationError(
                    f"lost the rendezvous at {self.addr}:{self.port} ({exc}); "
                    + ("rank 0 serves it when no torchrun agent does: did rank 0 fail?"
                       if not self.agent else "is torchrun's agent still running?")) from None
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise FormationError(f"{what} within {self.timeout_s:g} s"
                                     + (f" ({detail()})" if detail else "") + ".")
            time.sleep(POLL_SECONDS)

    def posted(self, *keys: str):
        """The values of ``keys`` if all are posted, else None."""
        if not self.store.check(list(keys)):
            return None
        return [json.loads(self.store.get(k)) for k in keys]


def form(launch: Launch, environ, timeout_s: float) -> None:
    """Make this process rank ``launch.rank`` of a ``launch.size``-rank MPI world together
    with the launch's other processes (collective over all of them).  Its rank in
    ``MPI_COMM_WORLD`` differs from ``RANK`` when a host's ranks are not consecutive; ``init()``
    orders the world by ``RANK``.  Raises :class:`FormationError` on every process when any
    step fails.

    One store may serve several formations (torchrun's agent keeps its store across the
    rounds of an elastic job, with the same restart count), so each formation identifies
    itself: every process arrives with a nonce, rank 0 consumes the arrivals, numbers the
    formation with the store's counter and posts a plan listing the nonces it took; a process
    acts only on a plan that lists its own nonce, and every later key carries the number."""
    global _world, commit_channel
    rank, size = launch.rank, launch.size
    assert rank is not None and size is not None
    rdv = _Rendezvous(launch, environ, timeout_s)
    where = f"the rendezvous at {rdv.addr}:{rdv.port}"
    nonce, generation = secrets.token_hex(8), None
    try:
        rdv.post(f"arrived/{rank}", {"host": socket.gethostname(), "nonce": nonce})
        if rank == 0:
            keys = [f"arrived/{r}" for r in range(size)]
            def absent() -> str:
                missing = [r for r in range(size) if not rdv.store.check([keys[r]])]
                return f"ranks {missing} never arrived: are they running, with WORLD_SIZE={size}?"
            try:
                rdv.wait(lambda: rdv.posted(*keys) and True,
                         f"not every process of the {size} that WORLD_SIZE names reached "
                         f"{where}", detail=absent)
            except FormationError as exc:   # tell those that did arrive
                came = [rdv.take(k)["nonce"] if rdv.store.check([k]) else None for k in keys]
                rdv.post("plan", {"generation": None, "nonces": came, "error": f"rank 0: {exc}"})
                raise
            found = [rdv.take(k) for k in keys]
            generation = int(rdv.store.add("generation", 1))
            hosts = [f["host"] for f in found]
            segments, mpi_rank = rank_order(hosts)
            nodes = [h for h, n in segments for _ in range(n)]
            plan = {"generation": generation, "nonces": [f["nonce"] for f in found],
                    "mpi_rank": mpi_rank}
            try:
                _world = MpiWorld(nodes, control_address(rdv.addr), timeout_s)
                proxies = _world.start(tied=True)
            except Exception as exc:  # noqa: BLE001 - every process must hear of it
                rdv.post("plan", {**plan, "error": f"rank 0: {exc}"})
                raise
            firsts = {h: min(r for r in range(size) if hosts[r] == h) for h, _ in segments}
            rdv.post("plan", {**plan, "release": _world.release_path,
                              "proxy": {str(firsts[h]): cmd for (h, _), cmd in
                                        zip(segments, proxies)}})

        def my_plan():
            got = rdv.posted("plan")
            return got[0] if got and got[0]["nonces"][rank:rank + 1] == [nonce] else None
        plan = rdv.wait(my_plan, f"rank 0 did not start the world's mpiexec through {where}")
        generation = plan["generation"]
        if "error" in plan:
            raise FormationError(f"forming the world failed on another process: "
                                 f"{plan['error']}")
        command = plan["proxy"].get(str(rank))
        if command is not None:
            hydra_member.start_proxy(command, plan["release"], tied=True)
        if rank == 0:
            envs = _world.environments()
            for r in range(size):
                rdv.post(f"g{generation}/env/{r}", envs[plan["mpi_rank"][r]])
        env, = rdv.wait(lambda: rdv.posted(f"g{generation}/env/{rank}"),
                        "this rank's MPI environment did not arrive", generation)
    except Exception as exc:  # noqa: BLE001 - the store's and mpiexec's errors alike
        rdv.fail(generation, str(exc))
        _end()
        raise FormationError(f"hvd.init() under {launch.describe()}: {exc}") from None
    atexit.register(_end)
    if rdv.agent:   # the agent's store outlives the workers: hvd.elastic's commits live there
        run, restarts = torchrun_attempt(environ)
        from torch.distributed import PrefixStore
        commit_channel = StoreChannel(PrefixStore(f"hvdlite/elastic/{run}", rdv.raw),
                                      "commits", world_number(restarts, generation - 1), rank)
    hydra_member.join_world(env, plan["mpi_rank"][rank], size,
                            f"process {rank} of {launch.launcher}")
    log.debug("formed rank %d of %d from %s (formation %d)", rank, size, launch.describe(),
              generation)


def _end() -> None:
    """At exit: release this host's placeholders (if this process runs its proxy), then end
    ``mpiexec`` (on rank 0)."""
    global _world
    hydra_member.stop_proxy()
    world, _world = _world, None
    if world is not None:
        world.close()
