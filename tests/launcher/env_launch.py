"""Launching jobs the way torchrun and Kubeflow's PyTorchJob do, for tests (issue 48).

* :func:`torchrun` - ``python -m torch.distributed.run`` (the ``torchrun`` command) with the
  test harness's environment and kill-on-timeout (tests/mpi_harness.py).
* :func:`env_processes` - the PyTorchJob layout without torchrun: one process per "pod", each
  started directly with the variables the Training Operator sets (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``), all in one process group killed on timeout.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from tests.mpi_harness import JobResult, base_env, run_command, worker_argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(nproc: int, argv: Sequence[str], *more: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node N`` (or with ``more`` options instead of
    ``--standalone``) running ``argv`` (a worker named by its path under tests/, or a
    command)."""
    options = list(more) or ["--standalone"]
    program = worker_argv(list(argv))
    if program[0] == sys.executable:
        program = program[1:]
    else:   # ["-c", code]: torchrun runs a command, not a script, with --no-python
        options.append("--no-python")
        program = [sys.executable, *program]
    return [sys.executable, "-m", "torch.distributed.run", *options, "--nproc-per-node",
            str(nproc), *program]


def torchrun(nproc: int, argv: Sequence[str], *more: str, timeout: float = 180,
             env: dict | None = None) -> JobResult:
    """A torchrun job on this machine (see :func:`torchrun_argv`)."""
    return run_command(torchrun_argv(nproc, argv, *more), nproc, timeout=timeout, env=env)


def pod_env(rank: int, size: int, port: int, addr: str = "127.0.0.1") -> dict[str, str]:
    """What the Training Operator sets in pod ``rank`` of a PyTorchJob (one process per pod)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": addr,
            "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}


def env_processes(size: int, argv: Sequence[str], timeout: float = 120,
                  env: dict | None = None, ranks: Sequence[int] | None = None) -> JobResult:
    """Start ``argv`` once per rank in ``ranks`` (default all of ``range(size)``) with the
    PyTorchJob variables and wait for all; on timeout the whole group is killed.  stdout and
    stderr are every process's, prefixed ``[rank r]``; returncode is the first non-zero."""
    out_dir = tempfile.mkdtemp(prefix="hvdlite-test-")
    port = free_port()
    procs: list[tuple[int, subprocess.Popen]] = []
    leader = None
    for rank in (range(size) if ranks is None else ranks):
        e = base_env({"HVDLITE_TEST_OUT": out_dir, **pod_env(rank, size, port), **(env or {})})
        e = {k: v for k, v in e.items() if v != ""}   # env={"VAR": ""} unsets VAR
        program = worker_argv(list(argv))
        if program[0] != sys.executable:
            program = [sys.executable, *program]   # ["-c", code]
        p = subprocess.Popen(program, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=e,
                             process_group=0 if leader is None else leader)
        leader = leader or p.pid
        procs.append((f"rank {rank}", p))
    return collect(procs, out_dir, size, timeout, lambda p: os.killpg(leader, signal.SIGKILL))


def collect(procs, out_dir: str, size: int, timeout: float, kill) -> JobResult:
    """Wait for every ``(label, Popen)`` of ``procs`` (all within ``timeout``; then
    ``kill(proc)`` for the first still running, which must end them all), and read the ranks'
    reports from ``out_dir``.  stdout and stderr are every process's, prefixed ``[label]``; the
    return code is the first non-zero one."""
    deadline, timed_out = time.monotonic() + timeout, False
    outs, errs, codes = [], [], []
    for label, p in procs:
        try:
            o, e = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill(p)
            o, e = p.communicate()
        outs.append(f"[{label}] {o}")
        errs.append(f"[{label}] {e}")
        codes.append(p.returncode)
    results = [json.loads((Path(out_dir) / f"rank{q}.json").read_text()) for q in range(size)
               if (Path(out_dir) / f"rank{q}.json").exists()]
    code = next((c for c in codes if c), 0)
    return JobResult(None if timed_out else code, "\n".join(outs), "\n".join(errs), timed_out,
                     results)
