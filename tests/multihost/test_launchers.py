"""hvdlite's launchers across simulated hosts: ``hvdlite run -H``, ``hvdlite run --hostfile``
and ``hvdlite.run(func, hosts=...)``, each started from the head with nothing but the
environment a user on a cluster would have (Hydra's ssh launcher is the stand-in through
HYDRA_LAUNCHER_EXEC, which ``hvdlite run`` passes on to mpiexec unchanged)."""
import json
import sys

import pytest

from tests.mpi_harness import TESTS
from tests.multihost.hosts import check_host_job, host_list
from tests.multihost.layouts import LAYOUTS

TIMEOUT = 120
HVDLITE_RUN = [sys.executable, "-m", "hvdlite.runner", "run"]
WORKER = [sys.executable, str(TESTS / "multihost/workers/multihost_worker.py")]
RUN_FUNC_DRIVER = str(TESTS / "launcher/workers/run_func_driver.py")


def _check_worker_job(job, key: str) -> None:
    expected = LAYOUTS[key]
    check_host_job(job, expected.size)
    for rank, report in enumerate(job.results):
        failed = {case: why for case, why in report.items() if why is not None}
        assert "topology" in report and "placement" in report and not failed, \
            f"rank {rank}: {failed or sorted(report)}"


def test_hvdlite_run_hosts(host_bed):
    """``-H host:slots,...``; the layout's expectations reach every rank only through ``-x``
    and the launcher's forwarding (the stand-in starts each host with a fresh environment)."""
    expected = LAYOUTS["2+2"]
    job = host_bed.run(HVDLITE_RUN + ["-H", host_list(expected.layout),
                                      "-x", "HVDLITE_TEST_EXPECT"] + WORKER,
                       expected.size, timeout=TIMEOUT, env=expected.env())
    _check_worker_job(job, "2+2")


def test_hvdlite_run_hostfile(host_bed):
    """``--hostfile`` with Open MPI's ``host slots=N`` lines and a comment; no -np (the total
    of the slots)."""
    expected = LAYOUTS["3+1"]
    hostfile = host_bed.root / "jobs" / "hostfile-3+1"
    hostfile.write_text("# two machines\n" + "".join(f"{host} slots={slots}\n"
                                                   for host, slots in expected.layout))
    job = host_bed.run(HVDLITE_RUN + ["--hostfile", str(hostfile)] + WORKER, expected.size,
                       timeout=TIMEOUT, env=expected.env())
    _check_worker_job(job, "3+1")


@pytest.mark.parametrize("key", ["2+2", "3+1"])
def test_run_function_on_hosts(host_bed, key):
    """``hvdlite.run(func, hosts=..., num_proc=...)`` from a driver process on the head:
    every rank's return value comes back, in rank order, from the host the layout gives it."""
    expected = LAYOUTS[key]
    job = host_bed.run([sys.executable, RUN_FUNC_DRIVER, "on_hosts",
                        str(expected.size), host_list(expected.layout)], 0, timeout=TIMEOUT)
    check_host_job(job, 0)
    lines = [line for line in job.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, job.output
    got = json.loads(lines[0][len("RESULT "):])
    assert "error" not in got, got
    summed = [k * 5 * sum(r + 1 for r in range(expected.size)) for k in range(3)]
    want = [[rank, expected.size, local_rank, local_size, cross_rank, cross_size, host, summed]
            for rank, (host, local_rank, local_size, cross_rank, cross_size)
            in enumerate(expected.ranks)]
    assert got["value"] == want
