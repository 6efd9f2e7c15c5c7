"""The body of one Spark barrier task of :func:`hvdlite.spark.run`: forms the world with the
other tasks (:mod:`hvdlite.spark.formation`), then runs its rank as a child process and waits
for it.

The rank is a fresh ``python -m hvdlite.runner.task`` (the rank process of
:func:`hvdlite.run`): it fetches the pickled function from the driver, runs it, and sends back
its value or its exception.  A fresh process, not the Spark Python worker itself, because a
worker is reused for later tasks, and a process joins one MPI world in its life; it also keeps
the job's environment (``env=``) out of the worker.  The child dies with the task (a killed
task kills its rank), and its output travels to the driver, line by line, over the task's
connection.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from hvdlite.common.core import hydra_member
from hvdlite.runner.function_runner import ADDRESS_VARIABLE, KEY_VARIABLE

from . import formation


@dataclass
class TaskSpec:
    """What every task of one job needs; travels to the executors in Spark's closure (as
    Horovod's key does, so enable Spark's RPC encryption where that matters)."""
    address: tuple            # the driver's listener (host, port)
    key: bytes                # its authentication key
    start_timeout_s: float    # bound on every step of the formation
    env: dict = field(default_factory=dict)   # set in every rank's environment
    extra_mpi_args: list = field(default_factory=list)


class RankFailed(RuntimeError):
    """The rank process of this task ended with a non-zero status."""


def connect(spec: TaskSpec):
    from multiprocessing.connection import Client
    return Client(tuple(spec.address), authkey=spec.key)


def relay(stream, fd: int, rank: int, send) -> None:
    """Send the child's output on ``stream`` to the driver, one line per message (a last line
    without its newline at the end).  When the driver is gone, the output is still read (and
    dropped), so that the rank never blocks on a full pipe."""
    connected = True
    for line in iter(stream.readline, b""):
        if connected:
            try:
                send(("output", rank, fd, line))
            except (OSError, ValueError):
                connected = False
    stream.close()


def run_barrier_task(spec: TaskSpec, _rows: Iterator[Any]) -> Iterator[int]:
    """``mapPartitions`` body of the barrier stage: yields this task's rank once its rank
    process exited 0; raises (failing the stage, so Spark kills every other task) otherwise."""
    from pyspark import BarrierTaskContext
    context = BarrierTaskContext.get()
    conn = connect(spec)
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            conn.send(message)

    send(("started", context.partitionId(), context.getTaskInfos()[context.partitionId()]
          .address, os.getpid()))
    try:
        member = formation.form(context, spec.start_timeout_s, spec.extra_mpi_args)
    except BaseException as exc:
        send(("failed", context.partitionId(), f"{type(exc).__name__}: {exc}"))
        conn.close()
        raise
    try:
        send(("formed", member.partition, member.rank, member.host))
        environ = dict(os.environ)
        # The worker's import path, with what Spark added to it (addPyFile, --py-files): the
        # function may import those modules in the rank.
        environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        environ.update({k: str(v) for k, v in spec.env.items()})
        environ.update(member.env)
        environ[ADDRESS_VARIABLE] = f"{spec.address[0]}:{spec.address[1]}"
        environ[KEY_VARIABLE] = spec.key.hex()
        child = subprocess.Popen([sys.executable, "-m", "hvdlite.runner.task"], env=environ,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE,
                                 preexec_fn=hydra_member.die_with_parent)
        readers = [threading.Thread(target=relay, args=(stream, fd, member.rank, send),
                                    daemon=True)
                   for stream, fd in ((child.stdout, 1), (child.stderr, 2))]
        for reader in readers:
            reader.start()
        status = child.wait()
        for reader in readers:
            reader.join(5)
        if status != 0:
            how = (f"was killed by signal {-status} ({signal.Signals(-status).name})"
                   if status < 0 else f"exited with status {status}")
            raise RankFailed(f"rank {member.rank} (Spark partition {member.partition}, host "
                             f"{member.host}) {how}")
        # A rank still in MPI_Finalize needs its host's proxy and mpiexec; released before
        # every rank process has ended, a late one was killed by SIGSEGV there.  A failed
        # task ends the stage, and Spark then ends this wait with the others.
        context.barrier()
    finally:
        member.leave()
        conn.close()
    yield member.rank
