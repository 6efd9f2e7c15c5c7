"""torchrun and Kubeflow's PyTorchJob across simulated hosts (issue 48): one torchrun agent per
host (a PyTorchJob with torchrun in each pod), or one process per host started with the
Training Operator's variables (a PyTorchJob without torchrun).  ``hvd.init()`` forms one world
whose local and cross ranks follow the hosts, and the intra-node paths serve exactly the ranks
that share a host (tests/multihost/workers/multihost_worker.py's checks, the same as under
mpiexec)."""
from __future__ import annotations

import json

import pytest

from tests.launcher import env_launch
from tests.mpi_harness import JobResult, worker_argv
from tests.multihost.layouts import LAYOUTS, N1, N2, N3, Expected
from tests.multihost.pods import on_hosts

pytest.importorskip("torch")
TIMEOUT = 180
ENV_WORKER = "launcher/workers/env_world_worker.py"
ONE_PER_HOST = Expected(
    layout=((N1, 1), (N2, 1), (N3, 1)),
    ranks=[(N1, 0, 1, 0, 3), (N2, 0, 1, 1, 3), (N3, 0, 1, 2, 3)],
    homogeneous=True,
    sets={"global": ([0, 1, 2], False), "ends": ([0, 2], False)})


def _passed(job: JobResult, np_: int, cases=None) -> None:
    assert not job.timed_out and job.returncode == 0, job.output
    assert len(job.results) == np_, job.output
    for rank, report in enumerate(job.results):
        if cases is not None:
            assert set(report) >= set(cases), f"rank {rank} reported {sorted(report)}"
        failed = {k: v for k, v in report.items() if v is not None}
        assert not failed, f"rank {rank}: {failed}\n{job.output}"


def _torchrun(node: int, nnodes: int, nproc: int, argv, master: str, port: int) -> list[str]:
    return env_launch.torchrun_argv(nproc, argv, "--nnodes", str(nnodes), "--node-rank",
                                    str(node), "--master-addr", master, "--master-port",
                                    str(port))


def test_two_node_torchrun_follows_the_hosts(host_bed):
    """torchrun on two hosts, 2 ranks each (static rendezvous: node ranks as given): the 2+2
    layout's topology, process sets and intra-node paths, checked as under mpiexec."""
    expected = LAYOUTS["2+2"]
    port = env_launch.free_port()
    argv = ["multihost/workers/multihost_worker.py"]
    job = on_hosts(host_bed, {N1: _torchrun(0, 2, 2, argv, N1, port),
                              N2: _torchrun(1, 2, 2, argv, N1, port)}, 4, expected.env())
    _passed(job, 4, ["placement", "topology"])


def test_two_node_torchrun_with_a_c10d_rendezvous(host_bed):
    """``--rdzv-backend c10d --rdzv-endpoint host:port``: the agents' order is the
    rendezvous's, so the worker checks the topology against the hosts it finds."""
    port = env_launch.free_port()
    more = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{N1}:{port}",
            "--rdzv-id", "bed"]
    job = on_hosts(host_bed, {h: env_launch.torchrun_argv(2, [ENV_WORKER], *more)
                              for h in (N1, N2)}, 4, {})
    _passed(job, 4, ["identity", "topology", "collectives", "process_set"])


def test_pytorchjob_one_process_per_pod(host_bed):
    """Three pods (hosts), one process each, with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    as the Training Operator sets them: no torchrun, rank 0 serves the rendezvous."""
    port = env_launch.free_port()
    argv = worker_argv(["multihost/workers/multihost_worker.py"])
    job = on_hosts(host_bed, {h: ["env", *(f"{k}={v}" for k, v in
                                           env_launch.pod_env(r, 3, port, N1).items()), *argv]
                              for r, h in enumerate((N1, N2, N3))}, 3, ONE_PER_HOST.env())
    _passed(job, 3, ["placement", "topology"])


def test_hierarchical_allreduce_under_two_node_torchrun(host_bed):
    """The hierarchical paths' whole case list (multihost_hier_worker.py) under torchrun."""
    from tests.multihost.test_hierarchical import ENV, EXPECT
    port = env_launch.free_port()
    argv = ["multihost/workers/multihost_hier_worker.py"]
    env = {**ENV, "HVDLITE_TEST_EXPECT": json.dumps(EXPECT["2+2"])}
    job = on_hosts(host_bed, {N1: _torchrun(0, 2, 2, argv, N1, port),
                              N2: _torchrun(1, 2, 2, argv, N1, port)}, 4, env, timeout=300)
    _passed(job, 4)
