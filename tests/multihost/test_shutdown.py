"""The end of a job on two hosts whose ranks reach ``hvd.shutdown()`` at different times after
using their host's shared-memory window (tests/workers/multihost_shutdown_worker.py).

With MPICH's OFI netmod as it comes (RMA on), the rank that shuts down first aborts in
MPI_Finalize: its window was freed only locally (its peer shut down in a later negotiation
round), and OFI refuses to close a fabric with a window's RMA resources still open ("OFI call
fabricclose failed ... Device or resource busy").  Hydra then kills that host's other ranks and
the job exits non-zero.  The bed turns OFI RMA off for every other job (hosts.JOB_ENV), under
which the same job ends cleanly.
"""
import pytest

from tests.multihost.hosts import check_host_job
from tests.multihost.layouts import LAYOUTS

LAYOUT = LAYOUTS["2+2"].layout
WORKER = ["multihost_shutdown_worker.py"]
CASES = ["window_used", "shut_down"]


def _check(job):
    check_host_job(job, 4)
    for rank, report in enumerate(job.results):
        assert report == dict.fromkeys(CASES), f"rank {rank}: {report}"


def test_late_shutdown_ends_cleanly(host_job):
    _check(host_job(LAYOUT, WORKER, timeout=60))


@pytest.mark.xfail(strict=True, reason="known bug: a process set's shared-memory window that "
                   "was not freed collectively makes MPI_Finalize abort under MPICH's OFI "
                   "netmod with RMA on (notes: multihost-docs.md)")
def test_late_shutdown_ends_cleanly_with_ofi_rma(host_job):
    _check(host_job(LAYOUT, WORKER, timeout=60, env={"MPIR_CVAR_CH4_OFI_ENABLE_RMA": "-1"}))
