"""What the tests of engines that run a driver on a simulated host share (Ray in test_ray.py,
Spark in test_spark.py): a free port on a host's address, the driver's ``RESULT <json>`` line,
and the check that no MPI launcher process of the engine's worlds is left."""
from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from tests.ray.procs import launcher_processes


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def driver_result(proc: subprocess.Popen, engine: str, timeout: float = 240):
    """The JSON of the driver's last ``RESULT`` line; fails the test when the driver failed or
    ran past ``timeout`` (it is killed then)."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"the {engine} driver did not finish in {timeout} s:\n{stdout[-3000:]}\n"
                    f"{stderr[-4000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"driver failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def nothing_left(within_s: float = 20.0) -> None:
    """No mpiexec, proxy or placeholder of a manually launched world is left running."""
    deadline = time.monotonic() + within_s
    while launcher_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launcher_processes() == []


def assert_resumed_from_commits(steps: list[dict]) -> None:
    """Rank 0's step log of an elastic job that lost a host: nothing committed lost and nothing
    committed run again.  Rank 0 logs a step before its commit and the host dies at an arbitrary
    moment, so at a change of world a step logged but not committed may run once more;
    anywhere else the steps run on without a gap."""
    assert steps[0]["step"] == 0, steps[:3]
    for before, after in zip(steps, steps[1:]):
        if after["world"] == before["world"]:
            assert after["step"] == before["step"] + 1, (before, after)
        else:
            assert after["world"] > before["world"], (before, after)
            assert after["step"] in (before["step"], before["step"] + 1), (before, after)
