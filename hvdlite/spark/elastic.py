"""``hvdlite.spark.run_elastic``: Horovod's elastic ``horovod.spark.run_elastic``.

An elastic Spark job is a sequence of worlds, each one barrier stage (as in
:func:`hvdlite.spark.run`) sized to the task slots the cluster offers when it starts (between
``min_num_proc`` and ``max_num_proc``).  ``fn`` wraps its training in ``hvd.elastic.run``; its
ranks connect at ``hvd.init()`` to the commit server of ``hvdlite run``'s elastic driver
(:class:`~hvdlite.runner.elastic.server.Server`), which this process runs, and rank 0 ships its
commits there.

* A lost executor (or a rank that dies) fails the stage; Spark kills the other tasks, whose
  ranks have by then, or do at their watchdog's notice, handed in their newest commit.  The next
  world starts on the slots that remain, and its rank 0 resumes from the newest commit: the loss
  is the work since the last commit.
* When the cluster offers more slots than the running world uses (an executor came back or
  joined) and the world is below ``max_num_proc``, rank 0 is told that the hosts changed: every
  rank stops at its next ``state.commit()``, and the next world starts larger from that commit.
* ``fn`` raising on its own (not the collective failure a lost rank causes) ends the job with
  that rank's error, as in :func:`run`: a bug would fail again in every world.
"""
from __future__ import annotations

import logging
import os
import shlex
import types
import sys
import time
from typing import Any, Callable, Optional, Sequence, TextIO

from hvdlite.common.core import HorovodInternalError
from hvdlite.common.core import elastic_wire as wire
from hvdlite.runner.elastic import options
from hvdlite.runner.elastic.driver import RESET_LIMIT_MESSAGE
from hvdlite.runner.elastic.server import Server
from hvdlite.runner.launch_errors import UsageError
from hvdlite.runner.function_runner import (FunctionDriver, cloudpickle_module,
                                            collect_results, unpickled_exception)
from hvdlite.runner.horovodrun_flags import nic_env

from .runner import (POLL_S, Progress, SparkJob, driver_addresses, spark_context,
                     spark_error_summary, start_timeout_s)
from .task import TaskSpec

log = logging.getLogger("hvdlite.spark")

DISCOVER_S = 1.0       # how often the cluster's slots are counted while a world runs
REPORT_GRACE_S = 5.0   # after a world failed, how long its ranks get to hand in their commits
START_ATTEMPTS = 3     # worlds in a row that fail to start before the job gives up


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


def world_size(slots: int, min_np: int, max_np: int) -> Optional[int]:
    """The size of a world on ``slots`` free slots, or None when below ``min_np``.  Pure."""
    size = min(slots, max_np)
    return size if size >= min_np else None


class ElasticJob:
    """The worlds of one :func:`run_elastic` (see the module docstring)."""

    def __init__(self, context, payload: bytes, min_np: int, max_np: int, start_s: float,
                 elastic_s: float, reset_limit: Optional[int], env: dict,
                 extra_mpi_args: list, stdout: TextIO, stderr: TextIO,
                 timestamps: bool) -> None:
        self.context = context
        self.payload = payload
        self.min_np, self.max_np = min_np, max_np
        self.start_s, self.elastic_s = start_s, elastic_s
        self.reset_limit = reset_limit
        self.env, self.extra_mpi_args = env, extra_mpi_args
        self.streams = (stdout, stderr, timestamps)
        self.bind, self.advertised = driver_addresses(context.getConf())
        self.timestamp = 0

    def run(self) -> list:
        server = Server(self.bind)
        try:
            return self._loop(server)
        finally:
            server.close()

    def _loop(self, server: Server) -> list:
        resets = start_failures = 0
        index = 0
        while True:
            size = self._wait_for_slots()
            progress = Progress(size, *self.streams)
            driver = FunctionDriver(self.payload, self.bind, handlers=progress.handlers())
            env = {**self.env, wire.DRIVER_VARIABLE: f"{self.advertised}:{server.port}",
                   wire.KEY_VARIABLE: server.key.hex(), wire.WORLD_VARIABLE: str(index)}
            spec = TaskSpec((self.advertised, driver.port), driver.key, self.start_s, env,
                            self.extra_mpi_args)
            job = SparkJob(self.context, size, spec)
            log.info("hvdlite.spark: elastic: world %d: %d rank(s)", index, size)
            try:
                job.start()
                started = self._watch(server, index, job, progress, size)
            except BaseException:
                if job.running:
                    job.cancel()
                raise
            finally:
                driver.close()
            results = {rank: r for (w, rank), r in driver.results.items() if w == index}
            if job.error is None and len(results) == size:
                return collect_results(results, size, 0, "hvdlite.spark.run_elastic()")
            server.wait_for_reports(index, REPORT_GRACE_S)
            reason = self._classify(server, index, results, size, job, started)
            server.forget(index)
            if not started:
                start_failures += 1
                if start_failures > START_ATTEMPTS:
                    raise ElasticSparkError(f"{start_failures} worlds in a row could not "
                                            f"start; the last: {reason}")
            else:
                start_failures = 0
            log.warning("hvdlite.spark: elastic: world %d ended: %s", index, reason)
            if self.reset_limit is not None and resets >= self.reset_limit:
                raise ElasticSparkError(RESET_LIMIT_MESSAGE.format(self.reset_limit))
            resets += 1
            index += 1

    def _wait_for_slots(self) -> int:
        deadline = time.monotonic() + self.elastic_s
        while True:
            slots = task_slots(self.context)
            size = world_size(slots, self.min_np, self.max_np)
            if size is not None:
                return size
            if time.monotonic() > deadline:
                raise ElasticSparkError(
                    f"hvdlite.spark.run_elastic(): waited {self.elastic_s:g} s "
                    f"(elastic_timeout) for {self.min_np} task slots (min_num_proc), but the "
                    f"cluster offers {slots}. Add executors, or lower min_num_proc.")
            time.sleep(POLL_S)

    def _watch(self, server: Server, index: int, job: SparkJob, progress: Progress,
               size: int) -> bool:
        """Wait for the world's end; tell rank 0 when the cluster offers more slots.  Whether
        the world formed (False: it did not within the start timeout, and was cancelled)."""
        deadline = time.monotonic() + self.start_s
        notified = False
        last = time.monotonic()
        while job.running:
            now = time.monotonic()
            if not progress.all_formed() and now > deadline:
                log.warning("%s", progress.describe_start(self.start_s,
                                                          task_slots(self.context)))
                job.cancel()
                return False
            if progress.all_formed() and not notified and now - last >= DISCOVER_S:
                last = now
                if world_size(task_slots(self.context), self.min_np, self.max_np) > size:
                    notified = self._notify(server, index)
            time.sleep(POLL_S)
        return progress.all_formed()

    def _notify(self, server: Server, index: int) -> bool:
        coordinator = server.world_members(index).get(0)
        if coordinator is None or not coordinator.in_session or coordinator.outcome:
            return False
        self.timestamp += 1
        told = coordinator.send(("hosts_updated", self.timestamp,
                                 int(wire.HostUpdateResult.added)))
        if told:
            log.warning("hvdlite.spark: elastic: world %d: the cluster offers more task "
                        "slots; the ranks stop at their next commit", index)
        return told

    @staticmethod
    def _classify(server: Server, index: int, results: dict, size: int, job: SparkJob,
                  started: bool) -> str:
        """Why world ``index`` ended, for the log; raises when the job cannot go on (``fn``
        raised on its own on some rank)."""
        failed = {rank: unpickled_exception(data[1]) for rank, (ok, data) in results.items()
                  if not ok}
        own = [rank for rank, exc in sorted(failed.items())
               if not isinstance(exc, HorovodInternalError)]
        if own:
            collect_results(results, size, 1, "hvdlite.spark.run_elastic()")   # raises
        if not started:
            return "its tasks did not all start and form the world within the start timeout"
        members = server.world_members(index)
        outcomes = {r: m.outcome for r, m in members.items() if m.outcome}
        lost = sorted(r for r in range(size) if r not in outcomes and r not in results)
        if any(o[0] == "interrupt" for o in outcomes.values()) and not lost:
            return "the cluster's task slots changed"
        if lost:
            return (f"rank(s) {lost} ended without a word (their task, executor or host was "
                    f"lost); Spark: {spark_error_summary(job.error).splitlines()[0][:300]}"
                    if job.error else f"rank(s) {lost} ended without a word")
        resets = [(r, o[1]) for r, o in sorted(outcomes.items()) if o[0] == "reset"]
        if resets:
            return f"rank {resets[0][0]}: {str(resets[0][1]).splitlines()[-1][:300]}"
        return "the world ended early" + (f" ({spark_error_summary(job.error)[:300]})"
                                          if job.error else "")


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
