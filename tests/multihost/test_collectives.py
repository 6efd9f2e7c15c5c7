"""Every collective across simulated hosts, exact against numpy: the single-host suite's own
workers, launched with their ranks spread over hosts (2+2 and 3+1 ranks per host).

* core_ops_worker.py: allreduce (every op, dtype and shape; scaling; wrap-around), allgather
  with uneven first dimensions, broadcast from every root, barrier, ordering;
* core_collectives_worker.py: alltoall, reducescatter, grouped operations, Adasum;
* core_process_sets_worker.py static: every collective on process sets that lie within one
  host and sets that span hosts (a set's shared-memory window is used only in the former);
* core_steady_worker.py (2+2): cached steady state, fusion, and large tensors, whose intra-node
  paths stay unused when the ranks span hosts;
* core_early_worker.py: early reductions (the data beside the negotiation round) across hosts,
  the same bits as without them, counted exactly.
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, case_failures
from tests.multihost.hosts import check_host_job
from tests.multihost.layouts import LAYOUTS
from tests.workers import core_cases as cc
from tests.core.test_early import CASES as EARLY_CASES
from tests.core.workers.core_collectives_worker import cases_for as collectives_cases
from tests.core.workers.core_process_sets_worker import cases as process_set_cases

TIMEOUT = 240
WORKERS = {   # name -> (argv, environment, layouts, the cases it reports at 4 ranks)
    "ops": (["core/workers/core_ops_worker.py"], {}, ("2+2", "3+1"), cc.ops_cases(4)),
    "collectives": (["core/workers/core_collectives_worker.py"], {}, ("2+2", "3+1"),
                    collectives_cases(4)),
    "process_sets": (["core/workers/core_process_sets_worker.py", "static"], STALL_SAFETY_NET_ENV,
                     ("2+2", "3+1"), process_set_cases("static", 4)),
    "steady": (["core/workers/core_steady_worker.py", "default"], cc.STEADY_CONFIGS["default"],
               ("2+2",), cc.STEADY_CASES),
    "early": (["core/workers/core_early_worker.py"], {}, ("2+2", "3+1"), EARLY_CASES),
}


def _job(host_job, worker: str, key: str):
    argv, env, _, _ = WORKERS[worker]
    return host_job(LAYOUTS[key].layout, argv, timeout=TIMEOUT, env=env)


def _jobs():
    return [pytest.param(w, key, id=f"{w}-{key}") for w, (_, _, keys, _) in WORKERS.items()
            for key in keys]


def _params():
    for worker, (_, _, keys, cases) in WORKERS.items():
        for key in keys:
            for case in cases:
                yield pytest.param(worker, key, case, id=f"{worker}-{key}-{case}")


@pytest.mark.parametrize("worker,key", _jobs())
def test_job_ends_cleanly_and_reports_every_case(host_job, worker, key):
    job = _job(host_job, worker, key)
    check_host_job(job, 4)
    want = sorted(WORKERS[worker][3])
    for rank, report in enumerate(job.results):
        assert sorted(report) == want, (f"rank {rank}: missing {sorted(set(want) - set(report))}"
                                        f", unexpected {sorted(set(report) - set(want))}")


@pytest.mark.parametrize("worker,key,case", list(_params()))
def test_case(host_job, worker, key, case):
    job = _job(host_job, worker, key)
    problems = case_failures(job, case)
    if len(job.results) < 4:
        problems.append(f"only {len(job.results)} of 4 ranks reported\n{job.output}")
    assert not problems, "\n".join(problems)
