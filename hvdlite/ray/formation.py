"""Forming and ending the MPI world of a group of Ray workers, from the driver.

``group`` is anything with Ray Train's worker-group calls, ``execute_async(fn, *args)`` (every
worker, in world-rank order) and ``execute_single_async(rank, fn, *args)``: a Ray Train
execution group, or :class:`hvdlite.ray.executor.RayExecutor`'s workers.  The steps are
described in :mod:`hvdlite.common.runtime.hydra_world`; each ``ray.get`` is bounded by ``timeout_s``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayError

from . import member
from hvdlite.common.core import MpiWorld, WorldError

log = logging.getLogger("hvdlite.ray")


class WorkerGroup(Protocol):
    def execute_async(self, fn: Callable, *args: Any) -> list: ...

    def execute_single_async(self, rank: int, fn: Callable, *args: Any) -> Any: ...


def get_bounded(refs, timeout_s: float, what: str):
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise WorldError(f"the Ray workers did not {what} within {timeout_s:g} s") from None


def first_ranks(segments: Sequence[tuple[str, int]]) -> list[int]:
    """The world rank of each host segment's first worker (the one that runs its proxy)."""
    firsts, offset = [], 0
    for _, count in segments:
        firsts.append(offset)
        offset += count
    return firsts


def form_world(group: WorkerGroup, size: int, timeout_s: float) -> MpiWorld:
    """Make the ``size`` workers of ``group`` one MPI world (world rank = the group's rank).
    On any failure everything started here is ended again and WorldError (or the Ray error of
    a worker that died) is raised."""
    where = get_bounded(group.execute_async(member.describe), timeout_s, "report their nodes")
    if len(where) != size:
        raise WorldError(f"the worker group has {len(where)} workers, expected {size}")
    taken = [rank for rank, w in enumerate(where) if w["in_a_world"]]
    if taken:
        raise WorldError(f"the Ray workers of ranks {taken} (pids "
                         f"{[where[r]['pid'] for r in taken]}) already belong to an MPI world; "
                         f"a worker process joins one world only: form the new one from new "
                         f"workers (a new RayExecutor or Trainer run).")
    world = MpiWorld([w["node"] for w in where], ray.util.get_node_ip_address(), timeout_s)
    try:
        proxies = world.start()
        firsts = first_ranks(world.segments)
        get_bounded([group.execute_single_async(r, member.start_proxy, cmd,
                                                world.release_path)
                     for r, cmd in zip(firsts, proxies)],
                    timeout_s, "start their hosts' MPI proxies")
        envs = world.environments()
        get_bounded([group.execute_single_async(r, member.join_world, envs[r], r, size)
              for r in range(size)], timeout_s, "initialise MPI (MPI_Init)")
    except BaseException:
        end_world(group, world, timeout_s)
        raise
    log.info("hvdlite.ray: formed an MPI world of %d ranks on hosts %s", size, world.segments)
    return world


def end_world(group: WorkerGroup | None, world: MpiWorld, timeout_s: float) -> None:
    """End the world's launcher processes.  The workers that run the proxies release their
    placeholders and wait for their proxy to exit (every rank then has ended, so ``mpiexec``
    exits too); what is still running after that (the workers are gone or did not answer) is
    killed: ``mpiexec`` by the driver, which ends the proxies it still reaches.  Never raises for
    workers that are gone."""
    if group is not None:
        try:
            ray.get(group.execute_async(member.stop_proxy), timeout=timeout_s)
        except (RayError, ValueError) as exc:   # dead workers, or a group already shut down
            log.debug("hvdlite.ray: stopping the proxies through the workers failed: %s", exc)
    world.close()
