"""One MPI world formed from the tasks of a Spark barrier stage: the tasks' side.

Spark starts all tasks of a barrier stage together (or none), and
``BarrierTaskContext.allGather`` hands every task the messages of all of them.  Three
exchanges make the tasks one world with MPICH's manual launch, the formation that Ray and
torchrun use (:mod:`hvdlite.common.runtime.hydra_world`):

1. every task says on which host it runs; ranks are given host after host (Hydra gives each
   host one block of ranks), in order of each host's lowest partition, so ranks on one executor
   host are consecutive and share the node's fast paths;
2. the task of rank 0 starts ``mpiexec -launcher manual`` and says each host's proxy command;
   the first task of each host runs it;
3. rank 0 hands out every rank's PMI environment once every proxy runs.

A step that fails on some task is said in the next exchange, so every task raises
:class:`FormationError` with that task's words, not a hang: all exchanges are collective.
The rank process itself is started afterwards with its environment (:mod:`hvdlite.spark.task`).
"""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hvdlite.common.core import MpiWorld, hydra_member, rank_order


class FormationError(RuntimeError):
    """The tasks of a barrier stage could not form one world (the message says where)."""


@dataclass
class Member:
    """This task's place in the formed world."""
    rank: int
    size: int
    partition: int
    host: str
    env: dict            # the rank's PMI environment
    hosts: list          # [(host, ranks)] in rank order
    world: Optional[MpiWorld] = None   # mpiexec, on the task of rank 0

    def leave(self) -> None:
        """Release this host's placeholders (if this task runs the proxy) and end ``mpiexec``
        (on rank 0's task).  Safe to call more than once."""
        hydra_member.stop_proxy()
        world, self.world = self.world, None
        if world is not None:
            world.close()


def exchange(context: Any, message: Any) -> list:
    """Every task's ``message`` (JSON), indexed by partition (collective)."""
    return [json.loads(m) for m in context.allGather(json.dumps(message))]


def executor_host(context: Any, partition: int) -> str:
    """The address under which Spark reaches the executor of ``partition`` (other executors
    reach it there too): the host part of its task info's ``host:port``."""
    address = context.getTaskInfos()[partition].address
    return address.rpartition(":")[0] or address


def form(context: Any, timeout_s: float, extra_mpi_args: Sequence[str] = ()) -> Member:
    """Make the tasks of this barrier stage one MPI world (collective over all of them).  On
    failure everything started here is ended and :class:`FormationError` is raised on every
    task, naming the task and host where it failed."""
    partition = context.partitionId()
    host = socket.gethostname()
    hosts = [m["host"] for m in exchange(context, {"host": host})]
    size = len(hosts)
    segments, mpi_rank = rank_order(hosts)
    rank = mpi_rank[partition]
    root = mpi_rank.index(0)
    me = f"rank {rank} (Spark partition {partition}, host {host})"
    member = Member(rank, size, partition, host, {}, segments)
    try:
        plan: dict = {}
        if rank == 0:
            try:
                nodes = [h for h, count in segments for _ in range(count)]
                member.world = MpiWorld(nodes, executor_host(context, partition), timeout_s,
                                        extra_mpi_args)
                proxies = member.world.start(tied=True)
                firsts = [hosts.index(h) for h, _ in segments]
                plan = {"release": member.world.release_path,
                        "proxy": {str(p): cmd for p, cmd in zip(firsts, proxies)}}
            except Exception as exc:  # noqa: BLE001 - every task must hear of it
                plan = {"error": f"{me}: {exc}"}
        plan = exchange(context, plan)[root]
        if "error" in plan:
            raise FormationError(plan["error"])
        said: dict = {}
        try:
            command = plan["proxy"].get(str(partition))
            if command is not None:
                hydra_member.start_proxy(command, plan["release"], tied=True)
            if rank == 0:
                said["envs"] = member.world.environments()
        except Exception as exc:  # noqa: BLE001 - every task must hear of it
            said["error"] = f"{me}: {exc}"
        told = exchange(context, said)
        errors = [m["error"] for m in told if "error" in m]
        if errors:
            raise FormationError("; ".join(errors))
        member.env = told[root]["envs"][rank]
    except BaseException:
        member.leave()
        raise
    return member
