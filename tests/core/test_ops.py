"""Collectives against numpy references under real MPI launches (2 and 3 ranks).

One launch of tests/core/workers/core_ops_worker.py per rank count runs every case; each case is its
own test here.  Also: the steady-state worker (repeated steps with the same names, cache
invalidation, fusion batches) under several fusion/cache configurations.
"""
import pytest

from tests.mpi_harness import assert_case_passed
from tests.workers import core_cases as cc

def _params(cases_for):
    params = []
    for n in cc.NP_VALUES:
        for case in cases_for(n):
            params.append(pytest.param(n, case, id=f"np{n}-{case}"))
    return params


@pytest.mark.parametrize("np_,case", _params(cc.ops_cases))
def test_ops(mpi_job, np_, case):
    assert_case_passed(mpi_job(np_, ["core/workers/core_ops_worker.py"], timeout=150), np_, case)


@pytest.mark.parametrize("config", sorted(cc.STEADY_CONFIGS))
@pytest.mark.parametrize("np_,case", _params(lambda n: cc.STEADY_CASES))
def test_steady_state(mpi_job, np_, case, config):
    job = mpi_job(np_, ["core/workers/core_steady_worker.py", config], timeout=120,
                  env=cc.STEADY_CONFIGS[config])
    assert_case_passed(job, np_, case)
