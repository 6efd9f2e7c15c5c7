"""hvdlite.spark on a real multi-host Spark cluster: a standalone master and a worker on one
simulated host, a second worker on another (each in its host's namespaces, Spark's and MPI's
traffic between the hosts' loopback addresses), and the driver on the master's host.

* ``run`` with 4 tasks (2 per worker): one world across the hosts, each host's ranks
  consecutive, local and cross ranks by host, an allreduce across hosts, nothing left;
* ``run`` where the last rank ends 2 s after the others: it finalizes MPI cleanly;
* ``run_elastic`` losing a whole host (every process on it killed, its worker and executor
  included): the job goes on from the last commit on the host that is left.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("pyspark", reason="hvdlite.spark needs PySpark: pip install 'hvdlite[spark]'")
pytest.importorskip("torch")

from tests.mpi_harness import REPO  # noqa: E402
from tests.multihost.drivers import assert_resumed_from_commits, driver_result  # noqa: E402
from tests.multihost.drivers import free_port, nothing_left  # noqa: E402
from tests.multihost.hosts import JOB_ENV  # noqa: E402
from tests.multihost.layouts import N1, N2  # noqa: E402
from tests.ray.procs import read_steps, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(420)
BIN = os.path.dirname(sys.executable)
SPARK_CLASS = os.path.join(os.path.dirname(__import__("pyspark").__file__), "bin",
                           "spark-class")
DRIVER = REPO / "tests" / "multihost" / "workers" / "spark_driver.py"
ENV = {**JOB_ENV, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
       "PATH": f"{BIN}:/usr/bin:/bin", "PYSPARK_PYTHON": sys.executable}
if os.environ.get("JAVA_HOME"):
    ENV["JAVA_HOME"] = os.environ["JAVA_HOME"]


def _command(host_address: str, *argv: str, background: str | None = None) -> str:
    env = {**ENV, "SPARK_LOCAL_IP": host_address}
    line = "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + \
        shlex.join(argv)
    if background:   # a daemon of the host: it outlives the shell that started it
        line = f"nohup {line} > {shlex.quote(background)} 2>&1 < /dev/null &"
    return line


def _workers_registered(master_log: str, count: int) -> bool:
    try:
        with open(master_log) as f:
            return f.read().count("Registering worker") >= count
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def cluster(host_bed):
    bed = host_bed
    logs = tempfile.mkdtemp(prefix="spark-", dir=bed.root / "jobs")
    head = bed.hosts[N1].address
    port = free_port(head)
    master = f"spark://{head}:{port}"
    try:
        started = bed.shell(N1, _command(
            head, SPARK_CLASS, "org.apache.spark.deploy.master.Master", "--host", head,
            "--port", str(port), "--webui-port", str(free_port(head)),
            background=os.path.join(logs, "master.log")))
        assert started.returncode == 0, started.stderr
        for host in (N1, N2):
            address = bed.hosts[host].address
            started = bed.shell(host, _command(
                address, SPARK_CLASS, "org.apache.spark.deploy.worker.Worker", "--host",
                address, "--cores", "2", "--memory", "2g", "--webui-port",
                str(free_port(address)), "--work-dir", os.path.join(logs, f"work-{host}"),
                master, background=os.path.join(logs, f"worker-{host}.log")))
            assert started.returncode == 0, started.stderr
        wait_for("both Spark workers to register",
                 lambda: _workers_registered(os.path.join(logs, "master.log"), 2), 120)
        yield bed, master, logs
    finally:
        for host in (N2, N1):   # the hosts' JVMs: master, workers, executors
            bed.shell(host, "pkill -f org.apache.spark.deploy || true")
        bed.settle(15)


def _driver(bed, master: str, mode: str, out: str):
    """Run the driver on the master's host in the background: its Popen."""
    command = "cd " + shlex.quote(str(REPO)) + " && " + _command(
        bed.hosts[N1].address, sys.executable, str(DRIVER), mode, master,
        bed.hosts[N1].address, out)
    return subprocess.Popen([bed.standin, N1, command], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_run_forms_one_world_across_the_hosts_with_horovod_ranks(cluster):
    bed, master, logs = cluster
    result = driver_result(_driver(bed, master, "run", tempfile.mkdtemp(dir=logs)), "Spark")
    hosts = [r["host"] for r in result]
    assert [r["rank"] for r in result] == [0, 1, 2, 3]
    # two ranks per host, each host's ranks consecutive; local and cross ranks by host
    assert sorted(hosts) == sorted([N1, N1, N2, N2]) and hosts[0] == hosts[1] != hosts[2] \
        == hosts[3]
    assert [(r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"])
            for r in result] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert all(r["sum"] == [float(i * (1 + 2 + 3 + 4)) for i in range(4)] for r in result)
    nothing_left()


def test_run_ends_cleanly_when_one_rank_exits_late(cluster):
    """A rank whose process ends after the others' (here 2 s late) still finalizes MPI: no task
    releases its host's proxy or the world's mpiexec before every rank process has ended (it
    was killed by SIGSEGV in MPI_Finalize when they did)."""
    bed, master, logs = cluster
    result = driver_result(_driver(bed, master, "late_exit", tempfile.mkdtemp(dir=logs)),
                           "Spark")
    assert [r["rank"] for r in result] == [0, 1, 2, 3]
    nothing_left()


def test_run_elastic_survives_the_loss_of_a_whole_host(cluster):
    bed, master, logs = cluster
    out = tempfile.mkdtemp(dir=logs)
    proc = _driver(bed, master, "elastic", out)
    try:
        wait_for("3 steps on 4 ranks", lambda: sum(s["size"] == 4 for s in read_steps(out)) >= 3,
                 timeout_s=180)
        bed.kill_host(N2)   # every process on that host: worker, executor, ranks
        wait_for("3 steps on the host left", lambda: sum(
            s["world"] > 0 for s in read_steps(out)) >= 3, timeout_s=180)
    except AssertionError:
        open(os.path.join(out, "stop"), "w").close()
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"steps: {read_steps(out)[-5:]}\ndriver:\n{stdout[-3000:]}\n"
                             f"{stderr[-6000:]}") from None
    open(os.path.join(out, "stop"), "w").close()
    result = driver_result(proc, "Spark")
    steps = read_steps(out)
    assert_resumed_from_commits(steps)
    assert steps[0]["size"] == 4 and steps[-1]["size"] == 2
    assert [r["host"] for r in result] == [N1, N1]
    assert result[0]["params"] == result[1]["params"]
    nothing_left()
