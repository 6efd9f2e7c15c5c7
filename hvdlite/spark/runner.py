"""``hvdlite.spark.run``: Horovod's ``horovod.spark.run`` on Spark's barrier execution mode.

The driver (this process) serves the pickled function and collects the results exactly as
:func:`hvdlite.run` does (:class:`hvdlite.runner.function_runner.FunctionDriver`), and runs one
Spark job: a barrier stage of ``num_proc`` tasks, which Spark starts all at once or not at all.
Each task forms the world with the others (:mod:`hvdlite.spark.formation`) and runs its rank as
a child process (:mod:`hvdlite.spark.task`).  The tasks report here when they start and when
the world is formed (the start timeout names the tasks that never got there) and relay their
rank's output, which is printed here with Horovod's ``[rank]<stdout>:`` prefixes.

A rank that fails fails its task, so Spark fails the barrier stage (it never retries a failed
barrier result stage) and kills every other task, whose ranks die with them; the error raised
here is the rank's own traceback.
"""
from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from datetime import datetime
from typing import Any, Callable, Optional, Sequence, TextIO

from hvdlite.runner.function_runner import (FunctionDriver, cloudpickle_module,
                                            collect_results)
from hvdlite.runner.horovodrun_flags import nic_env

from .task import TaskSpec, run_barrier_task

START_TIMEOUT_VARIABLES = ("HVDLITE_SPARK_START_TIMEOUT", "HOROVOD_SPARK_START_TIMEOUT")
DEFAULT_START_TIMEOUT_S = 600.0
POLL_S = 0.2
CANCEL_WAIT_S = 60.0   # a cancelled Spark job's end (its tasks are killed)
_job_ids = iter(range(1, 1 << 62))


def spark_context():
    """The active SparkContext; RuntimeError when there is none."""
    try:
        import pyspark
    except ImportError:
        raise ImportError("hvdlite.spark needs PySpark: pip install hvdlite[spark] "
                          "(pyspark>=4)") from None
    context = pyspark.SparkContext._active_spark_context
    if context is None:
        raise RuntimeError("hvdlite.spark: no active SparkContext; create a SparkSession "
                           "first (SparkSession.builder.getOrCreate()).")
    return context


def start_timeout_s(start_timeout: Optional[float], environ=os.environ) -> float:
    """``start_timeout``, else ``HVDLITE_SPARK_START_TIMEOUT`` / ``HOROVOD_SPARK_START_TIMEOUT``,
    else 600 s (Horovod's default).  Pure logic."""
    if start_timeout is not None:
        value, source = start_timeout, "start_timeout"
    else:
        source = next((v for v in START_TIMEOUT_VARIABLES if environ.get(v, "").strip()), None)
        value = environ[source] if source else DEFAULT_START_TIMEOUT_S
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"hvdlite.spark: {source} must be a number of seconds, got "
                         f"{value!r}") from None
    if seconds <= 0:
        raise ValueError(f"hvdlite.spark: {source} must be positive, got {value!r}")
    return seconds


def driver_addresses(conf) -> tuple[str, str]:
    """(address to bind, address the executors connect to) for the driver's listener: Spark's
    own driver addresses, which the executors already reach."""
    advertised = conf.get("spark.driver.host", None) or "127.0.0.1"
    return conf.get("spark.driver.bindAddress", None) or advertised, advertised


class Progress:
    """What the tasks of one job reported: which started, which joined the world, and their
    ranks' output (written to the driver's streams with Horovod's ``[rank]<stdout>:`` tags)."""

    def __init__(self, size: int, stdout: TextIO, stderr: TextIO, timestamps: bool) -> None:
        self.size = size
        self.started: dict[int, str] = {}   # partition -> executor address
        self.formed: dict[int, tuple[int, str]] = {}   # partition -> (rank, host)
        self.failures: dict[int, str] = {}  # partition -> why the formation failed there
        self.streams = {1: stdout, 2: stderr}
        self.timestamps = timestamps
        self.lock = threading.Lock()

    def on_started(self, partition: int, address: str, _pid: int) -> None:
        self.started[partition] = address

    def on_formed(self, partition: int, rank: int, host: str) -> None:
        self.formed[partition] = (rank, host)

    def on_failed(self, partition: int, message: str) -> None:
        self.failures[partition] = message

    def on_output(self, rank: int, fd: int, line: bytes) -> None:
        name = "stdout" if fd == 1 else "stderr"
        text = line.decode("utf-8", "replace")
        stamp = datetime.now().strftime("%a %b %d %H:%M:%S %Y") + ":" if self.timestamps else ""
        with self.lock:
            stream = self.streams[fd]
            stream.write(f"{stamp}[{rank}]<{name}>:{text}" + ("" if text.endswith("\n")
                                                             else "\n"))
            stream.flush()

    def handlers(self) -> dict[str, Callable[..., None]]:
        return {"started": self.on_started, "formed": self.on_formed,
                "failed": self.on_failed, "output": self.on_output}

    def all_formed(self) -> bool:
        return len(self.formed) == self.size

    def describe_start(self, waited_s: float, slots: int) -> str:
        """Why the world did not form within ``waited_s``: the tasks that never started (most
        often: not enough free task slots for a barrier stage) or never joined."""
        missing = [p for p in range(self.size) if p not in self.started]
        lines = [f"hvdlite.spark.run(): the {self.size} Spark tasks did not form one world "
                 f"within the start timeout ({waited_s:g} s)."]
        if missing:
            lines.append(
                f"Tasks (partitions) {missing} never started ({len(self.started)} of "
                f"{self.size} did). Spark starts a barrier stage only when it can run all of "
                f"its tasks at once, so it needs {self.size} free task slots; the cluster "
                f"offers {slots} (spark.default.parallelism), and other jobs may hold some. "
                f"Lower num_proc, free or add executors, or raise start_timeout (or "
                f"HVDLITE_SPARK_START_TIMEOUT) when executors are allocated on demand.")
        waiting = [p for p in self.started if p not in self.formed]
        if waiting and not missing:
            lines.append(f"Tasks {sorted(waiting)} started but never joined the world "
                         f"(executors {[self.started[p] for p in sorted(waiting)]}).")
        for partition, message in sorted(self.failures.items()):
            lines.append(f"partition {partition}: {message}")
        return "\n".join(lines)


class SparkJob:
    """The Spark job of one :func:`run`: a barrier stage of ``size`` tasks, collected on its own
    thread (which inherits the caller's job group and local properties) under a job tag."""

    def __init__(self, context, size: int, spec: TaskSpec) -> None:
        from pyspark import InheritableThread
        self.context = context
        self.size = size
        self.tag = f"hvdlite-spark-run-{os.getpid()}-{next(_job_ids)}"
        self.error: Optional[BaseException] = None
        self.ranks: Optional[list] = None
        self.thread = InheritableThread(target=self._collect, args=(spec,), daemon=True,
                                        name=self.tag)

    def _collect(self, spec: TaskSpec) -> None:
        try:
            self.context.addJobTag(self.tag)
            try:
                rdd = self.context.range(0, self.size, numSlices=self.size).barrier()
                self.ranks = rdd.mapPartitions(
                    lambda rows: run_barrier_task(spec, rows)).collect()
            finally:
                self.context.removeJobTag(self.tag)
        except BaseException as exc:  # noqa: BLE001 - reported by run() on the caller's thread
            self.error = exc

    def start(self) -> None:
        self.thread.start()

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def cancel(self) -> None:
        """Cancel the job (Spark kills its tasks, their ranks die with them) and wait for its
        end."""
        self.context.cancelJobsWithTag(self.tag)
        self.thread.join(CANCEL_WAIT_S)


OWN_ERRORS = ("RankFailed:", "FormationError:")   # hvdlite.spark's words in a task's error


def spark_error_summary(error: BaseException) -> str:
    """The useful part of a failed Spark job's error: the tasks' own words when they said
    why (a rank that exited, a formation that failed), else the first lines of the message (a
    Py4J error carries the JVM's whole stack trace).  Pure logic."""
    lines = str(error).strip().splitlines()
    own = list(dict.fromkeys(line.strip() for line in lines
                             if any(mark in line for mark in OWN_ERRORS)))
    if own:
        return "\n".join(own)
    keep = [line for line in lines if not line.lstrip().startswith("at ")]
    return "\n".join(keep[:40])


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[dict] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[dict] = None,
        stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None, verbose: int = 1,
        nics: Optional[Sequence[str]] = None,
        prefix_output_with_timestamp: bool = False) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks that form one hvdlite world, and
    return its return values in rank order (Horovod's ``horovod.spark.run``).

    ``fn`` calls ``hvd.init()`` itself; it travels by value (cloudpickle), so closures and
    functions defined in a notebook work.  ``num_proc`` defaults to the cluster's default
    parallelism.  The tasks run in one barrier stage: Spark starts them all at once, so it needs
    ``num_proc`` free task slots; ``start_timeout`` (default ``HVDLITE_SPARK_START_TIMEOUT`` or
    ``HOROVOD_SPARK_START_TIMEOUT``, else 600 s) bounds the wait for every task to start and
    join, and its expiry raises ``TimeoutError`` naming the tasks that never started.  Ranks on
    the same executor host are consecutive and use the node's shared-memory paths.

    Each rank is a child process of its task, with the executor's environment plus ``env``;
    its output is printed on ``stdout``/``stderr`` (default: ``sys.stdout``/``sys.stderr``),
    each line tagged ``[rank]<stdout>:`` (with a timestamp in front when
    ``prefix_output_with_timestamp``).  ``extra_mpi_args`` are added to the ``mpiexec`` that
    forms the world; ``nics`` points NCCL and libfabric at those interfaces.  ``use_gloo``
    raises ``ValueError`` (hvdlite runs over MPI only); ``use_mpi`` and ``verbose`` are
    accepted.

    If ``fn`` raises on a rank, or a rank dies, Spark fails the stage and kills every other
    task with its rank, and this raises ``RuntimeError`` with the traceback of the first rank
    that failed on its own, that rank's exception as the cause.
    """
    if not callable(fn):
        raise TypeError(f"hvdlite.spark.run(): fn must be callable, got {type(fn).__name__}.")
    if use_gloo:
        raise ValueError("hvdlite.spark.run(): use_gloo=True: hvdlite runs over MPI only (no "
                         "Gloo controller); drop use_gloo.")
    context = spark_context()
    if num_proc is None:
        num_proc = context.defaultParallelism
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"hvdlite.spark.run(): num_proc must be a positive int, got "
                         f"{num_proc!r}")
    timeout = start_timeout_s(start_timeout)
    job_env = {**nic_env(list(nics or ())), **{k: str(v) for k, v in (env or {}).items()}}
    payload = cloudpickle_module().dumps((fn, tuple(args), dict(kwargs or {})))
    progress = Progress(num_proc, stdout or sys.stdout, stderr or sys.stderr,
                        prefix_output_with_timestamp)
    bind, advertised = driver_addresses(context.getConf())
    driver = FunctionDriver(payload, bind, handlers=progress.handlers())
    spec = TaskSpec((advertised, driver.port), driver.key, timeout, job_env,
                    shlex.split(extra_mpi_args or ""))
    job = SparkJob(context, num_proc, spec)
    try:
        if verbose >= 2:
            print(f"hvdlite.spark.run(): {num_proc} processes", file=sys.stderr)
        job.start()
        deadline = time.monotonic() + timeout
        while job.running and not progress.all_formed():
            if time.monotonic() > deadline:
                job.cancel()
                raise TimeoutError(progress.describe_start(timeout, context.defaultParallelism))
            time.sleep(POLL_S)
        job.thread.join()
    except BaseException:
        if job.running:   # interrupted (KeyboardInterrupt): leave nothing running
            job.cancel()
        raise
    finally:
        driver.close()
    results = {rank: result for (world, rank), result in driver.results.items() if world == 0}
    if job.error is None:
        return collect_results(results, num_proc, 0, "hvdlite.spark.run()")
    raise job_failure(results, num_proc, progress, job.error, "hvdlite.spark.run()")


def job_failure(results: dict, size: int, progress: Progress, error: BaseException,
                caller: str) -> RuntimeError:
    """The error for a failed Spark job: the ranks' own story (the first rank's traceback, as
    :func:`hvdlite.run` tells it), then what the tasks said (a rank that exited or was
    killed, a formation that failed), with the failing rank's exception as the cause."""
    cause: Optional[BaseException] = None
    try:
        collect_results(results, size, 1, caller)
        story = f"{caller}: the Spark job failed."
    except RuntimeError as exc:
        story, cause = str(exc), exc.__cause__
    lines = [story]
    lines += [f"partition {p}: {m}" for p, m in sorted(progress.failures.items())]
    lines.append("Spark: " + spark_error_summary(error))
    failure = RuntimeError("\n".join(lines))
    failure.__cause__ = cause
    return failure
