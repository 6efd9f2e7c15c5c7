"""CUDA tensors through hvdlite.torch under real MPI launches, on a machine with an NVIDIA GPU.

Skipped without a usable GPU (see conftest.py); run on a GPU machine with
``bash scripts/gpu_check.sh`` (or ``python -m pytest -q tests/gpu``).

One launch per job runs every case of tests/gpu/workers/gpu_torch_worker.py:

  nccl-np1          HVDLITE_GPU_OPERATIONS=nccl at 1 rank (NCCL refuses two ranks on one GPU):
                    allreduce (every op x dtype, in place / out of place / async, pre/postscale),
                    allgather, broadcast, alltoall and reducescatter (staged by the NCCL backend),
                    many small async or grouped allreduces (fusion), int16 allreduce refused with
                    GpuUnavailableError while int16 allgather/broadcast work, stream ordering,
                    autograd, the backend in use, zero-size tensors
  staged-np2        HVDLITE_GPU_OPERATIONS=mpi, 2 ranks sharing the GPU: the same (int16
                    reduces too, uneven allgather across ranks), plus a CPU tensor on one rank
                    and a CUDA tensor on the other under one name (TensorMismatchError on every
                    rank, the next op works) and join
  *-sync            the same with HVDLITE_ENABLE_ASYNC_COMPLETION=0 (the others run with
                    asynchronous completion, the default)
  train-*           DistributedOptimizer on small CUDA models (NCCL at 1 rank, staged at 2):
                    parameters bitwise identical on every rank and close to a single-process
                    run on the concatenated batch; with gradient buckets as by default, off
                    (-per-gradient) and small enough for several (-small-buckets)
  nccl-np2, train-nccl-np2   only where there are 2+ GPUs

Results are compared with torch references computed on the CPU (exact for integers and data
movement) and must be on the rank's own GPU.  ``test_check_build_shows_nccl`` checks
``hvdlite run --check-build`` and ``nccl_built()``.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.gpu.conftest import gpu_probe
from tests.gpu.workers import gpu_torch_worker as W
from tests.mpi_harness import REPO, base_env
from tests.torch.workers import torch_cases as C

WORKER = W.__file__
TIMEOUTS = {"collectives": 300, "train": 240}   # seconds per MPI job (killed after)
# Rank-skew tolerant (first CUDA use, kernel compilation), but a stuck case still ends as a
# StallError long before the job's timeout.
GPU_STALL_ENV = {"HVDLITE_STALL_CHECK_TIME_SECONDS": "30",
                 "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "60"}

# job id -> (worker mode, backend, number of ranks); every job runs with asynchronous completion
# (the default) except those in SYNC_JOBS (HVDLITE_ENABLE_ASYNC_COMPLETION=0: handles complete
# after the host saw the device work finish).
JOBS = {"nccl-np1": ("collectives", "nccl", 1),
        "nccl-np1-sync": ("collectives", "nccl", 1),
        "staged-np2": ("collectives", "staged", 2),
        "staged-np2-sync": ("collectives", "staged", 2),
        "train-nccl-np1": ("train", "nccl", 1),
        "train-nccl-np1-per-gradient": ("train", "nccl", 1),
        "train-staged-np2": ("train", "staged", 2),
        "train-staged-np2-small-buckets": ("train", "staged", 2)}
SYNC_JOBS = {"nccl-np1-sync", "staged-np2-sync"}
# DistributedOptimizer's gradient buckets: default (25 MiB: these models' gradients share
# one bucket after the first step), off, or 2 KiB (several buckets, large gradients alone).
BUCKET_ENV = {"train-nccl-np1-per-gradient": {"HVDLITE_GRADIENT_BUCKET_MB": "0"},
              "train-staged-np2-small-buckets": {"HVDLITE_GRADIENT_BUCKET_MB": "0.002"}}
if gpu_probe().devices >= 2:   # NCCL between ranks needs one GPU per rank
    JOBS.update({"nccl-np2": ("collectives", "nccl", 2),
                 "train-nccl-np2": ("train", "nccl", 2)})

# Known library bugs: "job/case" -> reason (strict xfail, so a fix shows up as XPASS).
XFAIL: dict[str, str] = {}


def _marks(job: str, case: str | None = None):
    marks = []
    if JOBS[job][1] == "nccl":
        marks.append(pytest.mark.nccl)
    key = f"{job}/{case}"
    if case is not None and key in XFAIL:
        marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[key]))
    return marks


def _job(mpi_job, job: str):
    mode, backend, np_ = JOBS[job]
    env = {"HVDLITE_GPU_OPERATIONS": W.GPU_OPERATIONS[backend], **GPU_STALL_ENV,
           "HVDLITE_ENABLE_ASYNC_COMPLETION": "0" if job in SYNC_JOBS else "1",
           **BUCKET_ENV.get(job, {})}
    return mpi_job(np_, [sys.executable, WORKER, mode, backend], timeout=TIMEOUTS[mode], env=env)


def _case_params():
    out = []
    for job, (mode, backend, np_) in JOBS.items():
        for case in W.cases(mode, backend, np_):
            out.append(pytest.param(job, case, id=f"{job}-{case}", marks=_marks(job, case)))
    return out


def test_case_lists_are_unique():
    for job, (mode, backend, np_) in JOBS.items():
        names = W.cases(mode, backend, np_)
        assert len(names) == len(set(names)), f"{job}: duplicate case names"


@pytest.mark.parametrize("job", [pytest.param(j, marks=_marks(j)) for j in JOBS])
def test_worker_reports_every_case(mpi_job, job):
    mode, backend, np_ = JOBS[job]
    C.check_reported_cases(_job(mpi_job, job), np_, W.cases(mode, backend, np_))


@pytest.mark.parametrize("job, case", _case_params())
def test_gpu(mpi_job, job, case):
    C.check_case(_job(mpi_job, job), JOBS[job][2], case)


@pytest.mark.nccl
def test_nccl_built_reports_the_version():
    import hvdlite
    import hvdlite.torch as hvd
    from hvdlite.common.gpu import cuda
    version = hvdlite.nccl_built()
    assert isinstance(version, int) and version > 0, f"nccl_built() = {version!r}"
    assert hvd.nccl_built() == version == cuda.nccl_version()
    assert hvdlite.cuda_built() is True and hvd.cuda_built() is True


@pytest.mark.nccl
def test_check_build_shows_nccl():
    """``hvdlite run --check-build`` (run as a module: the console script may not be installed
    on the GPU machine) marks NCCL available with its 2.x.y version."""
    from hvdlite.common.gpu import cuda
    from hvdlite.runner.check_build import nccl_version_string
    env = base_env()
    proc = subprocess.run([sys.executable, "-m", "hvdlite.runner", "run", "--check-build"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    found = re.search(r"\[X\] NCCL \((2\.\d+\.\d+)\)", out)
    assert found, f"no '[X] NCCL (2.x.y)' line:\n{out}"
    assert found.group(1) == nccl_version_string(cuda.nccl_version()), out
    devices = re.search(r"CUDA: CuPy \S+, (\d+) devices? visible", out)
    assert devices and int(devices.group(1)) >= 1, f"no CUDA device in the report:\n{out}"
