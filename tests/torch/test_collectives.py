"""hvdlite.torch's alltoall, reducescatter, grouped ops, join, process sets and Adasum under real
MPI launches (2, 3 and 4 ranks).

One launch per (mode, rank count) runs every case (see
tests/torch/workers/torch_collectives_worker.py): "main" covers the global process set (alltoall:
every dtype, even/uneven splits as list and tensor, non-contiguous, async, autograd; reducescatter:
every op x dtype x row split, scaling, async, autograd; grouped allreduce/allgather/reducescatter
incl. mismatches; join with DistributedOptimizer and uneven steps; Adasum against the numpy tree
reference), "psets" runs every op on static process sets plus the ValueError of non-members.  Each
rank checks the results against its own torch/numpy reference built from every rank's deterministic
input.
"""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV
from tests.torch.workers import torch_cases as C
from tests.torch.workers import torch_collectives_worker as W

WORKER = "torch/workers/torch_collectives_worker.py"
TIMEOUT = 240

MODES = {"main": (W.NP_MAIN, W.main_cases), "psets": (W.NP_PSETS, W.pset_cases)}

# Known library bugs: case name -> reason (strict xfail, so a fix shows up as XPASS).
XFAIL: dict[str, str] = {}


def _job(mpi_job, mode, np_):
    return mpi_job(np_, [WORKER, mode], timeout=TIMEOUT, env=STALL_SAFETY_NET_ENV)


def _params():
    out = []
    for mode, (nps, cases_for) in MODES.items():
        for np_ in nps:
            for case in cases_for(np_):
                marks = ()
                if case in XFAIL:
                    marks = pytest.mark.xfail(strict=True, reason=XFAIL[case])
                out.append(pytest.param(mode, np_, case, id=f"{mode}-np{np_}-{case}",
                                        marks=marks))
    return out


def test_case_lists_are_unique():
    for mode, (nps, cases_for) in MODES.items():
        for np_ in nps:
            cases = cases_for(np_)
            assert len(cases) == len(set(cases)), f"{mode} np={np_}: duplicate case names"


@pytest.mark.parametrize("mode, np_", [(m, n) for m, (nps, _) in MODES.items() for n in nps],
                         ids=lambda v: str(v))
def test_worker_reports_every_case(mpi_job, mode, np_):
    C.check_reported_cases(_job(mpi_job, mode, np_), np_, MODES[mode][1](np_))


@pytest.mark.parametrize("mode, np_, case", _params())
def test_torch_collectives(mpi_job, mode, np_, case):
    C.check_case(_job(mpi_job, mode, np_), np_, case)
