"""Helpers for the Ray tests: a local Ray cluster per test module, and process checks."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ray_environment() -> None:
    """Set what this process's (and so its Ray cluster's) workers need: this checkout's hvdlite
    on PYTHONPATH, one thread, and Ray Train polling fast enough for short runs."""
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Every node on 127.0.0.1 (tests/conftest.py sets it before Ray is imported; here for
    # the processes the tests start).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray Train polls its workers every 2 s by default: reports and failure detection wait
    # for the poll; short runs in tests need it faster.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def start_ray(num_cpus: int = 4):
    """A local Ray cluster whose workers import this checkout's hvdlite."""
    import ray
    ray_environment()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    return ray


@contextlib.contextmanager
def node_cluster(head_cpus: int):
    """A local Ray cluster of several nodes (Ray's test ``Cluster``; ``add_node`` adds more),
    this process connected to it."""
    import ray
    from ray.cluster_utils import Cluster
    ray_environment()
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def read_steps(out: str) -> list[dict]:
    """The JSON lines of ``out/steps.jsonl`` (rank 0's record of each step), if any."""
    path = os.path.join(out, "steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def stop_ray() -> None:
    import ray
    ray.shutdown()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def wait_gone(pids, timeout_s: float = 20.0) -> list[int]:
    """Wait until none of ``pids`` runs; return those still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if alive(p)]
    return left


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def launcher_processes() -> list[tuple[int, str]]:
    """Running processes of an hvdlite.ray MPI world, of any job: its mpiexec, proxies and
    placeholders (the manual launcher and the placeholder's marker identify them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            line = cmdline(int(entry.name))
            if "HVDLITE_PMI" in line or ("hydra_pmi_proxy" in line
                                             and "--launcher manual" in line):
                found.append((int(entry.name), line))
    return found


def drain(cluster, node_id: str, deadline_s: int) -> None:
    """Have Ray drain ``node_id`` as a cloud's preemption would (``ray drain-node``)."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_cli, "drain-node", "--address", cluster.address, "--node-id", node_id,
                    "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                    "spot instance reclaimed (test)", "--deadline-remaining-seconds",
                    str(deadline_s)], check=True, timeout=60)


def wait_for(what, predicate, timeout_s=120):
    """Wait until ``predicate()``; fail the test, naming ``what``, after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
