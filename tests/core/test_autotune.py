"""Autotune under real MPI launches (2 and 3 ranks): a soak of allreduces, allgathers and
grouped allreduces checked exactly, step after step, while the tuner switches fusion
threshold, cycle time and the response cache every few steps; every rank switching to the same
settings at the same rounds; rank 0's log in Horovod's columns (see
tests/core/workers/core_autotune_worker.py)."""
import json
import os
import sys
import tempfile

import pytest

from tests.mpi_harness import (REPO, STALL_SAFETY_NET_ENV, assert_case_passed,
                               assert_every_case_reported, run_job)

CASES = ("autotune.soak", "autotune.same_switches", "autotune.log")
WORKER = ["core/workers/core_autotune_worker.py"]


def _env(np_: int) -> dict:
    log = os.path.join(tempfile.gettempdir(), f"hvdlite-autotune-{os.getpid()}-np{np_}.csv")
    # one step per part of a sample: a switch every 6 steps; 6 samples per cache setting
    return {"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "1",
            "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1",
            "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5", "HOROVOD_AUTOTUNE_LOG": log,
            **STALL_SAFETY_NET_ENV}


@pytest.mark.parametrize("np_", (2, 3))
@pytest.mark.parametrize("case", CASES)
def test_autotune(mpi_job, np_, case):
    assert_case_passed(mpi_job(np_, WORKER, timeout=180, env=_env(np_)), np_, case)


@pytest.mark.parametrize("np_", (2, 3))
def test_every_case_reported(mpi_job, np_):
    assert_every_case_reported(mpi_job(np_, WORKER, timeout=180, env=_env(np_)), np_, CASES)


def test_autotune_benchmark_short_run(tmp_path):
    """benchmarks/autotune_benchmark.py end to end on a tiny grid (its timings are never
    asserted): it checks every setting's results itself, and reports tuned against the grid's
    best and the default."""
    out = tmp_path / "result.json"
    job = run_job(2, [sys.executable, str(REPO / "benchmarks" / "autotune_benchmark.py"),
                      "--workloads", "small_fusion", "--grid-fusion-mb", "0.03125,4",
                      "--grid-cycle-ms", "1", "--steps", "2", "--blocks", "1",
                      "--warmup-samples", "0", "--steps-per-sample", "1", "--max-samples", "1",
                      "--json", str(out)], timeout=180)
    assert not job.timed_out and job.returncode == 0, job.output
    (result,) = json.loads(out.read_text())["workloads"]
    assert len(result["grid"]) == 4 and result["tuned"]["tuning_steps"] > 0
    assert set(result["steps_per_s"]) == {"tuned", "grid best", "default"}
    assert "tuned/best" in job.stdout and "tuned/default" in job.stdout
