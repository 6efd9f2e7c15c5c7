"""Autotune across two simulated hosts (2 + 2 ranks): the tuner sweeps the hierarchical
allreduce and allgather switches too, since the job spans hosts; the soak of
tests/core/workers/core_autotune_worker.py stays exact while every rank switches, between the
same rounds, the engine's hierarchical path on and off along with the fusion threshold, cycle
time and response cache."""
import pytest

from tests.mpi_harness import STALL_SAFETY_NET_ENV, case_failures
from tests.multihost.hosts import check_host_job
from tests.multihost.layouts import LAYOUTS

CASES = ("autotune.soak", "autotune.same_switches", "autotune.log")
# One step per part of a sample, 2 Bayesian samples per combination of the on/off switches
# (8 across hosts): 24 switches.  The log stays in rank 0's host's private /tmp (checked there).
ENV = {"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "1",
       "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "2",
       "HOROVOD_AUTOTUNE_LOG": "/tmp/hvdlite-autotune.csv", "HVDLITE_TEST_SPANS_HOSTS": "1",
       **STALL_SAFETY_NET_ENV}


@pytest.mark.parametrize("case", CASES)
def test_autotune_across_hosts(host_job, case):
    job = host_job(LAYOUTS["2+2"].layout, ["core/workers/core_autotune_worker.py"],
                   timeout=240, env=ENV)
    check_host_job(job, 4)
    problems = case_failures(job, case)
    assert not problems, "\n".join(problems)
