"""Fixtures for jobs across simulated hosts (see hosts.py): one bed of hosts for the whole test
session, and launches cached per (layout, command, environment) so that the per-case tests of
one worker share one launch, as tests/conftest.py's ``mpi_job`` does.

Where namespaces are unavailable (not root, no unshare) the tests are skipped with the reason;
with HVDLITE_TEST_REQUIRE_HOSTS=1 (CI sets it) that is a failure instead, so a machine that
should run them cannot skip them silently.
"""
from __future__ import annotations

import os

import pytest

from tests.multihost.hosts import BedUnavailable, HostBed, Layout, unavailable_reason
from tests.multihost.layouts import HOST_NAMES


def _unavailable(reason: str) -> None:
    message = f"multi-host tests need Linux namespaces: {reason}"
    if os.environ.get("HVDLITE_TEST_REQUIRE_HOSTS") == "1":
        pytest.fail(message + " (HVDLITE_TEST_REQUIRE_HOSTS=1)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def host_bed():
    """The simulated hosts (layouts.HOST_NAMES), created once and torn down at the end, when
    it is also checked that nothing is left running and nothing leaked into the real mount
    namespace or /etc/hosts."""
    reason = unavailable_reason()
    if reason:
        _unavailable(reason)
    bed = HostBed(HOST_NAMES)
    try:
        bed.start()
    except BedUnavailable as exc:
        _unavailable(str(exc))
    yield bed
    problems = bed.close()
    assert not problems, "tearing the simulated hosts down: " + "; ".join(problems)


@pytest.fixture(scope="session")
def host_job(host_bed):
    """``host_job(layout, argv, timeout=, env=, hostfile=)``: ``mpiexec`` across the hosts
    (:meth:`HostBed.mpiexec`), run once per distinct call in the session."""
    jobs: dict = {}

    def get(layout: Layout, argv: list[str], timeout: float = 180, env: dict | None = None,
            hostfile: bool = False):
        key = (tuple(layout), tuple(argv), tuple(sorted((env or {}).items())), hostfile)
        if key not in jobs:
            jobs[key] = host_bed.mpiexec(layout, argv, timeout=timeout, env=env,
                                         hostfile=hostfile)
        return jobs[key]
    return get


@pytest.fixture(scope="session")
def operator_bed(host_bed):
    """Hosts named as the Kubeflow MPI Operator names the workers of
    examples/kubernetes/digits-mpijob.yaml, taking ssh logins on the manifest's sshd port only
    (so a launch without ``-p PORT`` is refused, as on those pods).  Made after ``host_bed``,
    whose checks and skip it shares."""
    pytest.importorskip("yaml", reason="PyYAML reads examples/kubernetes/digits-mpijob.yaml")
    from tests.launcher import kubernetes_example
    job = kubernetes_example.mpijob()
    yield from _named_bed(kubernetes_example.worker_names(job), "the operator's",
                          ssh_port=kubernetes_example.ssh_port(job))


@pytest.fixture(scope="session")
def pytorchjob_bed(host_bed):
    """Hosts named as Kubeflow's Training Operator names the pods of
    examples/kubernetes/digits-pytorchjob.yaml (``<job>-master-0``, ``<job>-worker-<i>``).
    Made after ``host_bed``, whose checks and skip it shares."""
    pytest.importorskip("yaml", reason="PyYAML reads examples/kubernetes/digits-pytorchjob.yaml")
    from tests.launcher import kubernetes_example
    yield from _named_bed([pod for pod, _, _ in
                           kubernetes_example.pytorchjob_pods(kubernetes_example.pytorchjob())],
                          "the PyTorchJob's")


def _named_bed(names, whose: str, ssh_port: int = 22):
    """A bed of hosts with these names for a session fixture: started, yielded, torn down
    (checked)."""
    bed = HostBed(names, ssh_port=ssh_port)
    try:
        bed.start()
    except BedUnavailable as exc:
        _unavailable(str(exc))
    yield bed
    problems = bed.close()
    assert not problems, f"tearing {whose} simulated hosts down: " + "; ".join(problems)
