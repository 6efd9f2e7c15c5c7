"""Topology and intra-node paths of jobs spanning simulated hosts (tests/multihost/workers/
multihost_worker.py), for the layouts of layouts.py: 2+2, 3+1 and 1+2+1 ranks per host.

One launch per layout; every case is its own test.  The expected topology is written down in
layouts.py from Horovod's definitions; the paths cases check that hvdlite's shared-memory window
and direct copies serve process sets whose ranks share a host, and never one that spans hosts.
"""
import pytest

from tests.multihost.hosts import check_host_job
from tests.multihost.layouts import LAYOUTS, Expected

TIMEOUT = 120


def _job(host_job, key: str):
    expected = LAYOUTS[key]
    return host_job(expected.layout, ["multihost/workers/multihost_worker.py"], timeout=TIMEOUT,
                    env=expected.env())


def _cases(expected: Expected, rank: int) -> list[str]:
    """What ``rank`` reports: placement, topology, and the paths of each set it is in."""
    return ["placement", "topology"] + [f"paths.{name}" for name, (ranks, _) in
                                        expected.sets.items() if len(ranks) > 1 and rank in ranks]


def _params():
    for key, expected in LAYOUTS.items():
        names = dict.fromkeys(c for rank in range(expected.size) for c in _cases(expected, rank))
        for case in names:
            yield pytest.param(key, case, id=f"{key}-{case}")


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_job_ends_cleanly_and_reports_every_case(host_job, key):
    expected = LAYOUTS[key]
    job = _job(host_job, key)
    check_host_job(job, expected.size)
    for rank, report in enumerate(job.results):
        assert sorted(report) == sorted(_cases(expected, rank)), f"rank {rank}: {sorted(report)}"


@pytest.mark.parametrize("key,case", list(_params()))
def test_case(host_job, key, case):
    expected = LAYOUTS[key]
    job = _job(host_job, key)
    assert len(job.results) == expected.size, job.output
    problems = [f"rank {rank}: {report[case]}" for rank, report in enumerate(job.results)
                if case in _cases(expected, rank) and report.get(case, "not reported")]
    assert not problems, "\n".join(problems)
