"""The elastic examples keep training when a worker is killed from outside, as a node failure
would: examples/pytorch_elastic_digits.py on hvdnode1 and hvdnode2 (one rank each) loses the
worker on hvdnode2 in its third epoch, goes on alone from the last commit, and grows back to two
ranks when hvdnode2's blacklist cooldown ends; examples/keras_elastic_digits.py, compressing
with PowerSGD (whose factors and error feedback start over in the new world), loses its worker on
hvdnode2 and finishes on hvdnode1.  Both must reach their accuracy bar."""
from __future__ import annotations

import re
import subprocess
import sys
import threading

from tests.mpi_harness import REPO, base_env
from tests.multihost import procs

HVDLITE_RUN = [sys.executable, "-m", "hvdlite.runner", "run"]
TIMEOUT = 400


def _run_and_kill(host_bed, flags: list[str], script: str, args: list[str], when: str,
                  victim_host: str) -> tuple[int, str, str]:
    """Start the job from the head; once its output has a line matching ``when``, SIGKILL the
    example's process on ``victim_host``.  Returns (status, stdout, stderr)."""
    command = host_bed.head_command(HVDLITE_RUN + flags + [sys.executable,
                                                           str(REPO / "examples" / script),
                                                           *args])
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=base_env(host_bed.launcher_env()), cwd=REPO,
                            start_new_session=True)
    out: list[str] = []
    err: list[str] = []
    killed = threading.Event()

    def watch() -> None:
        for line in proc.stdout:
            out.append(line)
            if not killed.is_set() and re.search(when, line):
                host = host_bed.hosts[victim_host]
                victims = [pid for pid in host_bed._inside(host)
                           if script in procs.cmdline(pid) and "shield" not in procs.cmdline(pid)]
                procs.kill(victims)
                killed.set()

    readers = [threading.Thread(target=watch, daemon=True),
               threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        status = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        host_bed.kill_everything(proc.pid)
        status = None
    for reader in readers:
        reader.join(10)
    host_bed.settle()
    assert status is not None, f"the job hung\n{''.join(out)[-3000:]}\n{''.join(err)[-3000:]}"
    assert killed.is_set(), f"never saw {when!r}\n{''.join(out)[-3000:]}"
    return status, "".join(out), "".join(err)


def _accuracy(stdout: str) -> float:
    found = re.findall(r"test accuracy: ([0-9.]+)", stdout)
    assert found, stdout[-3000:]
    return float(found[-1])


def test_pytorch_elastic_example_survives_a_killed_worker_and_grows_back(host_bed):
    status, out, err = _run_and_kill(
        host_bed, ["-np", "2", "--min-np", "1", "--max-np", "2", "-H", "hvdnode1:1,hvdnode2:1",
                   "--blacklist-cooldown-range", "1", "2"],
        "pytorch_elastic_digits.py", ["--epochs", "12", "--epoch-seconds", "0.3",
                                      "--min-accuracy", "0.9"],
        when=r"^epoch +2 ", victim_host="hvdnode2")
    assert status == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "blacklisted hvdnode2" in err and "world 2: 2 rank(s)" in err, err[-3000:]
    resumed = re.findall(r"training on (\d) ranks from epoch (\d+)", out)
    assert [ranks for ranks, _ in resumed] == ["2", "1", "2"], out[-3000:]
    assert int(resumed[1][1]) >= 2, "the second world must resume where the first stopped"
    assert _accuracy(out) >= 0.9


def test_keras_elastic_example_survives_a_killed_worker(host_bed):
    status, out, err = _run_and_kill(
        host_bed, ["-np", "2", "--min-np", "1", "--max-np", "2", "-H", "hvdnode1:1,hvdnode2:1"],
        "keras_elastic_digits.py", ["--epochs", "8", "--epoch-seconds", "0.3",
                                    "--compression", "powersgd", "--min-accuracy", "0.9"],
        when=r"^epoch +1 ", victim_host="hvdnode2")
    assert status == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "blacklisted hvdnode2" in err, err[-3000:]
    resumed = re.findall(r"training on (\d) ranks from epoch (\d+), (\d+) samples", out)
    assert [ranks for ranks, _, _ in resumed] == ["2", "1"], out[-3000:]
    assert _accuracy(out) >= 0.9
