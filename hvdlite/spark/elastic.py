"""``hvdlite.spark.run_elastic``: Horovod's elastic ``horovod.spark.run_elastic``.

An elastic Spark job is a sequence of worlds, each one barrier stage (as in
:func:`hvdlite.spark.run`) sized to the task slots the cluster offers when it starts (between
``min_num_proc`` and ``max_num_proc``).  ``fn`` wraps its training in ``hvd.elastic.run``; its
ranks connect at ``hvd.init()`` to the commit server
(:class:`~hvdlite.runner.elastic.server.Server`) of the elastic driver this process runs
(:mod:`hvdlite.runner.elastic.driver`, ``hvdlite run``'s, with :class:`SparkProvider` starting
the worlds), and rank 0 ships its commits there.

* A lost executor (or a rank that dies) fails the stage; Spark kills the other tasks, whose
  ranks have by then, or do at their watchdog's notice, handed in their newest commit.  The next
  world starts on the slots that remain, and its rank 0 resumes from the newest commit: the loss
  is the work since the last commit.
* When the cluster's task slots would size the world differently (an executor came back or
  joined, and the world is below ``max_num_proc``; or one left), rank 0 is told that the hosts
  changed: every rank stops at its next ``state.commit()``, and the next world starts at the new
  size from that commit.
* ``fn`` raising on its own (not the collective failure a lost rank causes) ends the job with
  that rank's error, as in :func:`run`: a bug would fail again in every world.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import types
import sys
import time
from typing import Any, Callable, Optional, Sequence, TextIO

from hvdlite.common.core import HorovodInternalError
from hvdlite.runner.elastic import options
from hvdlite.runner.elastic.driver import Discoverer, ElasticDriver, driver_variable
from hvdlite.runner.elastic.options import ElasticSettings
from hvdlite.runner.elastic.provider import WorldRecord
from hvdlite.runner.elastic.server import Server
from hvdlite.runner.launch_errors import UsageError
from hvdlite.runner.function_runner import (FunctionDriver, cloudpickle_module,
                                            collect_results, unpickled_exception)
from hvdlite.runner.horovodrun_flags import nic_env

from .runner import (POLL_S, Progress, SparkJob, driver_addresses, spark_context,
                     spark_error_summary, start_timeout_s)
from .task import TaskSpec

log = logging.getLogger("hvdlite.spark")

REPORT_GRACE_S = 5.0   # after a world failed, how long its ranks get to hand in their commits


class ElasticSparkError(RuntimeError):
    """The elastic Spark job cannot go on; the message says why."""


def task_slots(context) -> int:
    """How many tasks the cluster can run at once now (live executors' cores; Spark's own
    count for barrier stages), or the default parallelism where Spark does not say."""
    try:
        jsc = context._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(
            jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - an internal call: fall back to the public number
        return int(context.defaultParallelism)


class SparkSlots:
    """The driver's discovery for Spark: the cluster's task slots, as one host (Spark places
    the tasks; a lost executor is blamed on nobody, see :class:`SparkProvider`)."""

    HOST = "the cluster"

    def __init__(self, context) -> None:
        self.context = context

    def describe(self) -> str:
        return "the Spark cluster's task slots"

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        slots = task_slots(self.context)
        return {self.HOST: slots} if slots > 0 else {}


@dataclasses.dataclass
class SparkWorld:
    """What :class:`SparkProvider` holds of one world (``WorldRecord.handle``)."""
    job: SparkJob
    progress: Progress
    driver: FunctionDriver
    deadline: float                             # to form the world
    raw: dict = dataclasses.field(default_factory=dict)   # rank -> (ok, data), as returned


class SparkProvider:
    """Each world as one barrier stage (the elastic driver's provider; see the module
    docstring)."""

    host_word = "executor"
    blacklists = False           # Spark places the tasks: there is no host to set aside
    retries_own_errors = False   # a bug would fail again in every world, as in :func:`run`
    report_grace = REPORT_GRACE_S

    def __init__(self, job: "ElasticJob") -> None:
        self.job = job

    def host_name(self, host: str) -> str:
        return host

    def start(self, world: WorldRecord, env: dict[str, str]) -> None:
        job = self.job
        progress = Progress(world.size, *job.streams)
        driver = FunctionDriver(job.payload, job.bind, handlers=progress.handlers())
        env = {**job.env, **env, **driver_variable(job.server, job.advertised)}
        spec = TaskSpec((job.advertised, driver.port), driver.key, job.start_s, env,
                        job.extra_mpi_args)
        stage = SparkJob(job.context, world.size, spec)
        world.handle = SparkWorld(stage, progress, driver, time.monotonic() + job.start_s)
        log.info("hvdlite.spark: elastic: world %d: %d rank(s)", world.index, world.size)
        stage.start()

    def poll(self, world: WorldRecord, timeout: float) -> bool:
        handle: SparkWorld = world.handle
        if handle.job.running:
            if world.formed and not handle.progress.all_formed() and \
                    time.monotonic() > handle.deadline:
                log.warning("%s", handle.progress.describe_start(self.job.start_s,
                                                                 task_slots(self.job.context)))
                world.formed = False
                handle.job.cancel()
            else:
                time.sleep(min(timeout, POLL_S))
            if handle.job.running:
                return False
        world.formed = world.formed and handle.progress.all_formed()
        handle.raw = {rank: r for (w, rank), r in handle.driver.results.items()
                      if w == world.index}
        for rank, (ok, data) in handle.raw.items():
            if ok:
                world.results[rank] = data
                continue
            exc = unpickled_exception(data[1])
            if isinstance(exc, HorovodInternalError):   # what a lost rank makes the others
                world.died.append(rank)
            else:
                world.raised[rank] = exc
        if handle.job.error is not None:
            log.warning("hvdlite.spark: elastic: world %d: Spark: %s", world.index,
                        spark_error_summary(handle.job.error).splitlines()[0][:300])
            if world.failed_at is None:
                world.failed_at = time.monotonic()
        return True

    def stop(self, world: WorldRecord, hard: bool, signum: Optional[int] = None) -> None:
        if world.handle.job.running:
            world.handle.job.cancel()

    def settle(self, world: WorldRecord) -> None:
        pass   # nothing outlives the world's end but its workers' reports

    def finish(self, world: WorldRecord, failed: bool) -> None:
        handle: Optional[SparkWorld] = world.handle
        if handle is not None:
            if handle.job.running:
                handle.job.cancel()
            handle.driver.close()

    def error(self, world: WorldRecord, rank: int) -> BaseException:
        try:   # raises rank's error as run() does
            collect_results(world.handle.raw, world.size, 1, "hvdlite.spark.run_elastic()")
        except BaseException as exc:  # noqa: BLE001 - returned for the driver to raise
            return exc
        return ElasticSparkError(f"rank {rank} raised {world.raised[rank]}")

    def result(self, world: WorldRecord) -> list:
        return collect_results(world.handle.raw, world.size, 0, "hvdlite.spark.run_elastic()")


def say(message: str) -> None:
    """What the elastic driver tells the user of a Spark job: the log's warnings."""
    log.warning("hvdlite.spark: elastic: %s", message)


class ElasticJob:
    """The worlds of one :func:`run_elastic` (see the module docstring)."""

    def __init__(self, context, payload: bytes, min_np: int, max_np: int, start_s: float,
                 elastic_s: float, reset_limit: Optional[int], env: dict,
                 extra_mpi_args: list, stdout: TextIO, stderr: TextIO,
                 timestamps: bool) -> None:
        self.context = context
        self.payload = payload
        self.start_s, self.elastic_s = start_s, elastic_s
        self.env, self.extra_mpi_args = env, extra_mpi_args
        self.streams = (stdout, stderr, timestamps)
        self.bind, self.advertised = driver_addresses(context.getConf())
        self.settings = ElasticSettings(min_np, min_np, max_np, SparkSlots(context),
                                        reset_limit, None, elastic_s)
        self.server: Optional[Server] = None

    def timeout_error(self, need: int, have: int, _hosts_text: str) -> ElasticSparkError:
        return ElasticSparkError(
            f"hvdlite.spark.run_elastic(): waited {self.elastic_s:g} s (elastic_timeout) for "
            f"{need} task slots (min_num_proc), but the cluster offers {have}. Add executors, "
            f"or lower min_num_proc.")

    def run(self) -> list:
        self.server = Server(self.bind)
        discoverer = Discoverer(self.settings.discovery, say)
        try:
            driver = ElasticDriver(SparkProvider(self), self.settings, say, ElasticSparkError,
                                   self.timeout_error)
            return driver.run(self.server, discoverer)
        finally:
            discoverer.stop()
            self.server.close()


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (),
                kwargs: Optional[dict] = None, num_proc: Optional[int] = None,
                min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
                start_timeout: Optional[float] = None, elastic_timeout: Optional[float] = None,
                reset_limit: Optional[int] = None, env: Optional[dict] = None,
                stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
                verbose: int = 1, nics: Optional[Sequence[str]] = None,
                prefix_output_with_timestamp: bool = False, min_np: Optional[int] = None,
                max_np: Optional[int] = None, extra_mpi_args: Optional[str] = None,
                ) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job on Spark tasks and return the return
    values of its last world, in rank order (Horovod's ``horovod.spark.run_elastic``).

    ``fn`` calls ``hvd.init()`` and wraps its training in ``hvd.elastic.run`` with a state it
    commits.  Each world has as many ranks as the cluster has task slots when it starts,
    between ``min_num_proc`` (default ``num_proc``) and ``max_num_proc`` (default
    ``num_proc``); ``num_proc`` defaults to the default parallelism.  ``elastic_timeout``
    (default ``HOROVOD_ELASTIC_TIMEOUT``, else 600 s) bounds the wait for ``min_num_proc``
    slots; ``reset_limit`` the number of new worlds.  ``min_np``/``max_np`` are Horovod's older
    spellings.  Output, ``env``, ``nics``, ``extra_mpi_args`` and the start timeout are as in
    :func:`hvdlite.spark.run`.  See the module docstring for what happens when executors are
    lost or added.
    """
    if not callable(fn):
        raise TypeError(f"hvdlite.spark.run_elastic(): fn must be callable, got "
                        f"{type(fn).__name__}.")
    context = spark_context()
    num_proc = num_proc if num_proc is not None else context.defaultParallelism
    min_np = min_num_proc if min_num_proc is not None else (min_np if min_np is not None
                                                            else num_proc)
    max_np = max_num_proc if max_num_proc is not None else (max_np if max_np is not None
                                                            else num_proc)
    for name, value in (("num_proc", num_proc), ("min_num_proc", min_np),
                        ("max_num_proc", max_np)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"hvdlite.spark.run_elastic(): {name} must be a positive int, "
                             f"got {value!r}")
    if min_np > max_np:
        raise ValueError(f"hvdlite.spark.run_elastic(): min_num_proc={min_np} is above "
                         f"max_num_proc={max_np}")
    if reset_limit is not None and (not isinstance(reset_limit, int) or reset_limit < 0):
        raise ValueError(f"hvdlite.spark.run_elastic(): reset_limit must be a non-negative "
                         f"int, got {reset_limit!r}")
    job_env = {**nic_env(list(nics or ())), **{k: str(v) for k, v in (env or {}).items()}}
    payload = cloudpickle_module().dumps((fn, tuple(args), dict(kwargs or {})))
    try:   # hvdlite run's rule: the argument, else HVDLITE_/HOROVOD_ELASTIC_TIMEOUT, else 600
        elastic_s = options.elastic_timeout(types.SimpleNamespace(
            elastic_timeout=elastic_timeout), os.environ)
    except UsageError as exc:
        raise ValueError(f"hvdlite.spark.run_elastic(): {exc}") from None
    job = ElasticJob(context, payload, min_np, max_np, start_timeout_s(start_timeout),
                     elastic_s, reset_limit, job_env,
                     shlex.split(extra_mpi_args or ""), stdout or sys.stdout,
                     stderr or sys.stderr, prefix_output_with_timestamp)
    if verbose >= 2:
        print(f"hvdlite.spark.run_elastic(): {min_np}..{max_np} processes", file=sys.stderr)
    return job.run()
