"""The end of a job on two hosts whose ranks reach ``hvd.shutdown()`` at different times after
using their host's shared-memory window (tests/multihost/workers/multihost_shutdown_worker.py).

With MPICH's OFI netmod as it comes (RMA on), the rank that shut down first used to abort in
MPI_Finalize: its window was freed only locally (its peer shut down in a later negotiation
round), and OFI refuses to close a fabric with a window's RMA resources still open ("OFI call
fabricclose failed ... Device or resource busy"); Hydra then killed that host's other ranks.
Now every rank frees the window collectively in the round that ends the job.
"""
from tests.multihost.hosts import check_host_job
from tests.multihost.layouts import LAYOUTS

LAYOUT = LAYOUTS["2+2"].layout
WORKER = ["multihost/workers/multihost_shutdown_worker.py"]
CASES = ["window_used", "shut_down"]


def _check(job):
    check_host_job(job, 4)
    for rank, report in enumerate(job.results):
        assert report == dict.fromkeys(CASES), f"rank {rank}: {report}"


def test_late_shutdown_ends_cleanly(host_job):
    _check(host_job(LAYOUT, WORKER, timeout=60))


def test_late_shutdown_ends_cleanly_without_ofi_rma(host_job):
    _check(host_job(LAYOUT, WORKER, timeout=60, env={"MPIR_CVAR_CH4_OFI_ENABLE_RMA": "0"}))
