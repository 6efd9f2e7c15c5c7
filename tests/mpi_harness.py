"""Launch real multi-process MPI jobs from tests, never hanging.

Every job runs as its own ``mpiexec`` in a new process group with a timeout; on timeout the whole
group is killed and the test fails with the output so far, so a deadlock is a failure with a
message rather than a stuck CI.  Worker scripts report per-case results as JSON, one file per rank.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent   # a worker script is named by its path under here


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the venv's MPICH) first, then PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise RuntimeError("no mpiexec found; `pip install mpich` provides one")
    return found


def base_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                "TF_CPP_MIN_LOG_LEVEL": "2"})
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    for key in [k for k in env if k.startswith(("HVDLITE_", "HOROVOD_"))]:
        del env[key]  # tests set the knobs they mean explicitly
    env.update(extra or {})
    return env


# Jobs whose cases keep every rank in lock-step set this, so that a collective some rank never
# submits (a broken case, or a library bug) fails its case with a StallError naming the tensor
# instead of hanging the job until its timeout.  It is a safety net, not a timing assertion, so
# it leaves room for ranks that fall behind for reasons of the machine: the first torch optimizer
# a process builds imports torch._dynamo (~840 modules), and on a cold page cache one rank took
# 22 s for it and the other 6 s; CI once failed a case at the old 20 s limit for exactly this.
STALL_SAFETY_NET_ENV = {"HVDLITE_STALL_CHECK_TIME_SECONDS": "20",
                        "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "60"}


@dataclasses.dataclass
class JobResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    results: list[dict]   # per-rank JSON reports, in rank order (missing ranks omitted)

    @property
    def output(self) -> str:
        return f"--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


def worker_argv(argv: list[str]) -> list[str]:
    """``argv`` with a leading worker script, named by its path under tests/ (such as
    ``"torch/workers/torch_ops_worker.py"``: each group keeps its workers in its own
    ``workers/``), run by this Python."""
    first = argv[0]
    if first.endswith(".py") and not os.path.isabs(first) and (TESTS / first).exists():
        return [sys.executable, str(TESTS / first)] + list(argv[1:])
    return list(argv)


def run_command(cmd: list[str], np: int, timeout: float = 120, env: dict | None = None,
                cwd: str | os.PathLike | None = None, out_parent: str | None = None,
                on_timeout: Callable[[int], None] | None = None) -> JobResult:
    """Run the launch command ``cmd`` (an ``mpiexec``, ``hvdlite run``, ...) of an ``np``-rank
    job in its own process group, collecting the ranks' JSON reports.  The reports go to a new
    directory under ``out_parent`` (default: the system's temporary directory), named to the
    ranks as HVDLITE_TEST_OUT.  On timeout ``on_timeout(pid)`` runs first (to reach processes
    outside the group), then the group is killed."""
    out_dir = tempfile.mkdtemp(prefix="hvdlite-test-", dir=out_parent)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=base_env({"HVDLITE_TEST_OUT": out_dir, **(env or {})}),
                            cwd=cwd or REPO, start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        if on_timeout is not None:
            on_timeout(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    results = []
    for rank in range(np):
        path = Path(out_dir) / f"rank{rank}.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
    shutil.rmtree(out_dir, ignore_errors=True)
    return JobResult(None if timed_out else proc.returncode, stdout, stderr, timed_out, results)


def run_job(np: int, argv: list[str], timeout: float = 120, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> JobResult:
    """Run ``mpiexec -n np <argv>``; ``argv[0]`` may be a worker script named by its path under
    tests/ (``"core/workers/core_ops_worker.py"``), run with this Python."""
    return run_command([mpiexec_path(), "-n", str(np)] + worker_argv(argv), np,
                       timeout=timeout, env=env, cwd=cwd)


def check_job(job: JobResult, np: int, expect_success: bool = True) -> None:
    """Fail with the job's output if it hung, failed, or not every rank reported."""
    assert not job.timed_out, f"MPI job timed out (deadlock or hang?)\n{job.output}"
    if expect_success:
        assert job.returncode == 0, f"MPI job exited with {job.returncode}\n{job.output}"
        assert len(job.results) == np, (f"only {len(job.results)} of {np} ranks reported "
                                         f"results\n{job.output}")


def case_failures(job: JobResult, case: str) -> list[str]:
    """Messages of every rank that reported ``case`` as failed (or did not report it)."""
    problems = []
    for rank, report in enumerate(job.results):
        if case not in report:
            problems.append(f"rank {rank}: case not reported")
        elif report[case] is not None:
            problems.append(f"rank {rank}: {report[case]}")
    return problems


def assert_case_passed(job: JobResult, np: int, case: str) -> None:
    """The job ran cleanly on every rank and every rank reported ``case`` as passed."""
    check_job(job, np)
    problems = case_failures(job, case)
    assert not problems, "\n".join(problems)


def assert_every_case_reported(job: JobResult, np: int, want) -> None:
    """Every rank reported exactly the cases ``want`` (a worker that skipped or invented one
    would otherwise go unnoticed by the per-case tests)."""
    check_job(job, np)
    want = set(want)
    for rank, report in enumerate(job.results):
        assert set(report) == want, (f"rank {rank}: missing {sorted(want - set(report))[:10]}, "
                                     f"unexpected {sorted(set(report) - want)[:10]}")
