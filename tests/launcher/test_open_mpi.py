"""A script started by Open MPI's real ``mpirun`` while mpi4py uses the MPICH wheel (issue 48):
MPICH's ``MPI_Init`` would abort with "unsupported PMI version PMIx"; ``hvd.init()`` stops
first, on every process, naming both MPIs and what to launch with instead.  Open MPI is
Debian's ``openmpi-bin``, which .ci/run installs."""
import os
import re
import sys
from pathlib import Path

import pytest

from tests.mpi_harness import run_command

MPIRUN = Path("/usr/bin/mpirun.openmpi")


@pytest.fixture(scope="module")
def mpirun():
    if not MPIRUN.exists():
        message = "Open MPI's mpirun is not installed (apt-get install openmpi-bin)"
        if os.environ.get("HVDLITE_TEST_REQUIRE_OPENMPI") == "1":
            pytest.fail(message + " (HVDLITE_TEST_REQUIRE_OPENMPI=1)", pytrace=False)
        pytest.skip(message)
    return str(MPIRUN)


CODE = "import hvdlite as hvd; hvd.init(); print('trained alone', hvd.size())"


def _run(mpirun, np_, *options):
    return run_command([mpirun, "--allow-run-as-root", "--oversubscribe", *options, "-np",
                        str(np_), sys.executable, "-c", CODE], np_, timeout=120)


def _errors(job):
    errors = re.findall(r"LaunchError: (.*)", job.stdout + job.stderr)
    assert errors and all("Open MPI's mpirun" in e and "mpi4py uses MPICH" in e and
                          "same MPI" in e for e in errors), job.output
    assert "trained alone" not in job.stdout and "unsupported PMI version" not in job.stderr
    return errors


def test_open_mpis_mpirun_fails_the_job_with_a_launch_error(mpirun):
    job = _run(mpirun, 2)
    assert not job.timed_out and job.returncode != 0, job.output
    _errors(job)


@pytest.mark.parametrize("np_", [2, 3])
def test_every_process_says_why(mpirun, np_):
    """mpirun stops the other processes as soon as one exits with an error; with
    ``orte_abort_on_non_zero_status 0`` they run on (and mpirun exits 0 regardless), so that
    every process's own error can be checked."""
    job = _run(mpirun, np_, "--mca", "orte_abort_on_non_zero_status", "0")
    assert not job.timed_out, job.output
    errors = _errors(job)
    assert sorted(re.search(r"as rank (\d) of", e).group(1) for e in errors) == \
        [str(r) for r in range(np_)], errors
