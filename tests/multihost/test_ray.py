"""hvdlite.ray on a real multi-node Ray cluster: a head node on one simulated host and a worker
node on another (``ray start`` inside each host's namespaces, Ray's and MPI's traffic between
the hosts' loopback addresses), with the driver on the head's host, as on a cluster.

* ``RayExecutor(num_hosts=2, num_workers_per_host=2)``: one MPI world across the two nodes,
  ranks, local and cross ranks by node as Horovod defines them, an allreduce across hosts;
* ``HvdliteTrainer`` on 4 workers over both nodes: the same parameters on every rank;
* the elastic ``RayExecutor`` losing a whole node (its Ray node stopped, every process on it
  killed): the job goes on from the last commit on the node that is left.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("ray", reason="hvdlite.ray needs Ray: pip install 'hvdlite[ray]'")
pytest.importorskip("torch")

from tests.mpi_harness import REPO  # noqa: E402
from tests.multihost.drivers import assert_resumed_from_commits, driver_result  # noqa: E402
from tests.multihost.drivers import free_port, nothing_left  # noqa: E402
from tests.multihost.hosts import JOB_ENV  # noqa: E402
from tests.multihost.layouts import N1, N2  # noqa: E402
from tests.ray.procs import read_steps, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
BIN = os.path.dirname(sys.executable)
DRIVER = REPO / "tests" / "multihost" / "workers" / "ray_driver.py"
# The hosts' login environment is fresh (as over ssh): everything is passed on the command.
ENV = {**JOB_ENV, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:/usr/bin:/bin"}


def _command(*argv: str) -> str:
    return "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in ENV.items()) + " " + \
        shlex.join(argv)


def _start_node(bed, host: str, *args: str) -> None:
    address = bed.hosts[host].address
    done = bed.shell(host, _command(os.path.join(BIN, "ray"), "start",
                                    f"--node-ip-address={address}", "--num-cpus=2",
                                    "--object-store-memory=100000000",
                                    "--disable-usage-stats", *args), timeout=120)
    assert done.returncode == 0, f"ray start on {host}: {done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def cluster(host_bed):
    head = host_bed.hosts[N1].address
    port = free_port(head)
    try:
        _start_node(host_bed, N1, "--head", f"--port={port}", "--include-dashboard=false")
        _start_node(host_bed, N2, f"--address={head}:{port}")
        yield host_bed, f"{head}:{port}"
    finally:
        for host in (N2, N1):
            host_bed.shell(host, _command(os.path.join(BIN, "ray"), "stop", "--force"),
                           timeout=120)
        host_bed.settle(5)   # what Ray leaves behind (it should leave nothing) is killed


def _driver(bed, address: str, mode: str, out: str, timeout: float = 240):
    """Run the driver on the head's host in the background: its Popen."""
    command = _command(sys.executable, str(DRIVER), mode, address, bed.hosts[N1].address, out)
    return subprocess.Popen([bed.standin, N1, command], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _out(bed) -> str:
    return tempfile.mkdtemp(dir=bed.root / "jobs")   # a directory every host sees


def test_an_executor_world_spans_the_nodes_with_horovod_ranks(cluster):
    bed, address = cluster
    result = driver_result(_driver(bed, address, "executor", _out(bed)), "Ray")
    by_rank = sorted(result, key=lambda r: r["rank"])
    hosts = [r["host"] for r in by_rank]
    # Two ranks per node, each node's ranks consecutive; local and cross ranks by node.
    assert sorted(hosts) == sorted([N1, N1, N2, N2]) and hosts[0] == hosts[1] != hosts[2] \
        == hosts[3]
    assert [(r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"])
            for r in by_rank] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    expected = [float(i * (1 + 2 + 3 + 4)) for i in range(4)]
    assert all(r["sum"] == expected for r in by_rank)
    nothing_left()


def test_a_trainer_run_spans_the_nodes(cluster):
    bed, address = cluster
    out = _out(bed)
    assert driver_result(_driver(bed, address, "trainer", out), "Ray") == {"error": None}
    results = [json.load(open(os.path.join(out, f"result{r}.json"))) for r in range(4)]
    assert sorted(r["host"] for r in results) == sorted([N1, N1, N2, N2])
    assert all(r["params"] == results[0]["params"] for r in results)
    assert [s["step"] for s in read_steps(out)] == list(range(8))
    nothing_left()


def test_an_elastic_job_survives_the_loss_of_a_whole_node(cluster):
    bed, address = cluster
    out = _out(bed)
    proc = _driver(bed, address, "elastic", out)
    try:
        wait_for("3 steps on 4 workers", lambda: sum(s["size"] == 4 for s in read_steps(out)) >= 3)
        bed.kill_host(N2)   # every process on that host: the node is gone
        lost = time.monotonic()
        wait_for("3 steps on the node left", lambda: sum(
            s["world"] > 0 for s in read_steps(out)) >= 3, timeout_s=180)
        went_on = time.monotonic() - lost
    except AssertionError:
        open(os.path.join(out, "stop"), "w").close()
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"steps: {read_steps(out)[-5:]}\ndriver:\n{stdout[-3000:]}\n"
                             f"{stderr[-6000:]}") from None
    open(os.path.join(out, "stop"), "w").close()
    result = driver_result(proc, "Ray")
    steps = read_steps(out)
    assert_resumed_from_commits(steps)
    assert steps[0]["size"] == 4 and steps[-1]["size"] == 2
    assert [r["host"] for r in result] == [N1, N1]
    assert result[0]["params"] == result[1]["params"]
    print(f"\nnode lost -> 3 steps on the node left: {went_on:.1f} s")
    nothing_left()
