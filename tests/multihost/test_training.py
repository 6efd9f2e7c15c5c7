"""Training across simulated hosts (2 hosts x 2 ranks).

* DistributedOptimizer: the single-host suite's torch_optimizer_worker.py, every case of which
  checks that the parameters are bitwise identical on every rank (compared through mpi4py,
  independently of hvdlite) and match a single-process reference on the whole batch.
* The digits example (examples/pytorch_digits.py), started with ``hvdlite run -H`` as a user
  would start it on two machines, must reach its accuracy bar and write its checkpoint.
"""
import re
import sys

import pytest

from tests.mpi_harness import REPO, STALL_SAFETY_NET_ENV, case_failures
from tests.multihost.hosts import check_host_job, host_list
from tests.multihost.layouts import LAYOUTS
from tests.torch.workers import torch_cases as C

LAYOUT = LAYOUTS["2+2"].layout
TIMEOUT = 300


def _optimizer_job(host_job):
    return host_job(LAYOUT, ["torch/workers/torch_optimizer_worker.py"], timeout=TIMEOUT,
                    env=STALL_SAFETY_NET_ENV)


def test_optimizer_job_ends_cleanly_and_reports_every_case(host_job):
    job = _optimizer_job(host_job)
    check_host_job(job, 4)
    C.check_reported_cases(job, 4, C.OPTIMIZER_CASES)


@pytest.mark.parametrize("case", C.OPTIMIZER_CASES)
def test_distributed_optimizer(host_job, case):
    job = _optimizer_job(host_job)
    problems = case_failures(job, case)
    assert len(job.results) == 4 and not problems, "\n".join(problems) or job.output


def test_digits_example_with_hvdlite_run(host_bed):
    checkpoint = host_bed.root / "digits.pt"
    job = host_bed.run([sys.executable, "-m", "hvdlite.runner", "run", "-H", host_list(LAYOUT),
                        sys.executable, str(REPO / "examples" / "pytorch_digits.py"),
                        "--epochs", "20", "--min-accuracy", "0.95",
                        "--checkpoint", str(checkpoint)], 4, timeout=TIMEOUT)
    check_host_job(job, 0)
    assert "training on 4 ranks" in job.stdout, job.output
    assert job.stdout.count("epoch ") == 20, "progress must be printed by rank 0 only"
    accuracy = [float(a) for a in re.findall(r"test accuracy:? ([0-9.]+)", job.stdout)]
    assert accuracy and accuracy[-1] >= 0.95, job.output
    assert checkpoint.exists(), "rank 0 did not write the checkpoint"
