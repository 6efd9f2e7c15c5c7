"""Processes started on several simulated hosts at once, each by its own command, as a
Kubernetes operator starts one container per pod or as torchrun runs one agent per node (no MPI
launcher reaches the hosts): used by the torchrun and PyTorchJob tests."""
from __future__ import annotations

import shlex
import subprocess
import tempfile

from tests.launcher.env_launch import collect
from tests.mpi_harness import REPO, JobResult, base_env
from tests.multihost.hosts import JOB_ENV, HostBed

TIMEOUT = 180


def on_hosts(bed: HostBed, commands: dict[str, list[str]], np_: int, env: dict,
             timeout: float = TIMEOUT) -> JobResult:
    """Run ``commands[host]`` on each host at once (as ssh would: a login shell in the repo,
    with ``env``), wait for all, collect the ranks' reports; on timeout kill everything."""
    out_dir = tempfile.mkdtemp(prefix="torchrun-", dir=str(bed.root / "jobs"))
    full = base_env({"HVDLITE_TEST_OUT": out_dir, **JOB_ENV, **env})
    keep = {k: v for k, v in full.items() if k.startswith(("HVDLITE_", "HOROVOD_", "MPIR_",
                                                           "FI_", "OMP_", "MKL_", "PYTHON",
                                                           "TF_", "PATH"))}
    procs = {}
    for host, argv in commands.items():
        line = (f"cd {shlex.quote(str(REPO))} && exec env "
                + " ".join(f"{k}={shlex.quote(v)}" for k, v in keep.items())
                + " " + shlex.join(argv))
        procs[host] = subprocess.Popen([bed.standin, host, line], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
    job = collect(list(procs.items()), out_dir, np_, timeout, lambda p: bed.kill_everything(p.pid))
    leftovers = bed.settle()
    assert not leftovers, f"left running on the hosts: {leftovers}"
    return job
