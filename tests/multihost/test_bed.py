"""The simulated hosts themselves (hosts.py): separate names, /dev/shm and /tmp; names that
resolve to loopback on the hosts and the head but not on the real machine; an ssh stand-in that
fails like ssh; a timeout that kills a job on every host, under mpiexec and ``hvdlite run``."""
import json
import socket
import subprocess
import sys

import pytest

from tests.multihost.hosts import ADDRESS_PREFIX, host_list
from tests.multihost.layouts import HOST_NAMES, LAYOUTS

LAYOUT = LAYOUTS["2+2"].layout
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_each_host_has_its_name_and_resolves_every_host_to_loopback(host_bed):
    here = socket.gethostname()
    for index, name in enumerate(HOST_NAMES, start=1):
        out = host_bed.shell(name, f"hostname; getent hosts {' '.join(HOST_NAMES)} {here}")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.split("\n")
        assert lines[0] == name
        resolved = {line.split()[1]: line.split()[0] for line in lines[1:] if line.strip()}
        assert resolved == {**{n: f"{ADDRESS_PREFIX}{i}"
                               for i, n in enumerate(HOST_NAMES, start=1)},
                            here: "127.0.0.1"}, out.stdout


def test_shm_and_tmp_are_private_to_each_host(host_bed):
    first, second = HOST_NAMES[:2]
    made = host_bed.shell(first, "echo mark > /dev/shm/bed-mark && echo mark > /tmp/bed-mark")
    assert made.returncode == 0, made.stderr
    try:
        seen = host_bed.shell(second, "ls /dev/shm/bed-mark /tmp/bed-mark")
        assert seen.returncode != 0, "a host sees another host's /dev/shm or /tmp"
        with pytest.raises(FileNotFoundError):
            open("/dev/shm/bed-mark")
        with pytest.raises(FileNotFoundError):
            open("/tmp/bed-mark")
        again = host_bed.shell(first, "cat /dev/shm/bed-mark /tmp/bed-mark")
        assert again.stdout.split() == ["mark", "mark"], "a host lost its own files"
        shared = host_bed.shell(second, f"ls {host_bed.root}/etc-hosts")   # the shared directory
        assert shared.returncode == 0, shared.stderr
    finally:
        host_bed.shell(first, "rm -f /dev/shm/bed-mark /tmp/bed-mark")


def test_host_names_do_not_resolve_on_the_real_machine(host_bed):
    with open("/etc/hosts") as f:
        real = f.read()
    for name in HOST_NAMES:
        assert name not in real
        with pytest.raises(OSError):
            socket.gethostbyname(name)


def test_standin_fails_like_ssh(host_bed):
    unknown = host_bed.shell("no-such-host", "true")
    assert unknown.returncode == 255
    assert "Could not resolve hostname no-such-host" in unknown.stderr
    refused = subprocess.run([host_bed.standin, "-p", "2222", HOST_NAMES[0], "true"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 255 and "port 2222: Connection refused" in refused.stderr
    # options as ssh reads them; the command words are joined for the login shell, which
    # starts with a fresh environment in the home directory
    ok = subprocess.run([host_bed.standin, "-x", "-o", "BatchMode=yes", "-p22", "-T",
                         f"root@{HOST_NAMES[1]}", "echo", "$(hostname)", "\"$PYTHONPATH\"", "a",
                         "&& pwd"], capture_output=True, text=True, timeout=30,
                        env={"PYTHONPATH": "/not/forwarded", "PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0, ok.stderr
    home = ok.stdout.split("\n")[1]
    assert ok.stdout.split("\n")[0] == f"{HOST_NAMES[1]}  a" and home.startswith("/"), ok.stdout


def test_hydra_logs_in_through_the_standin(host_bed):
    """How Hydra calls ssh (what the next launcher work builds on): ``-x HOST "PROXY" ...``,
    once per host, and the job's ranks run where the layout puts them."""
    log = host_bed.root / "standin.log"
    start = log.stat().st_size if log.exists() else 0
    job = host_bed.mpiexec(LAYOUT, [sys.executable, "-c", "import os, socket; "
                                    "os.write(1, (socket.gethostname() + '\\n').encode())"],
                           timeout=60)
    assert job.returncode == 0 and not job.leftovers, job.output
    assert sorted(job.stdout.split()) == sorted(["hvdnode1"] * 2 + ["hvdnode2"] * 2)
    with open(log) as f:
        f.seek(start)
        calls = [json.loads(line)["argv"] for line in f]
    assert sorted(call[1] for call in calls) == [host for host, _ in LAYOUT], calls
    for call in calls:
        assert call[0] == "-x" and call[2].strip('"').endswith("hydra_pmi_proxy"), call


@pytest.mark.parametrize("launcher", ["mpiexec", "hvdlite run"])
def test_timeout_kills_the_job_on_every_host(host_bed, launcher):
    if launcher == "mpiexec":
        job = host_bed.mpiexec(LAYOUT, SLEEPER, timeout=8)
    else:   # hvdlite run starts mpiexec in a session of its own
        job = host_bed.run([sys.executable, "-m", "hvdlite.runner", "run", "-H",
                            host_list(LAYOUT)] + SLEEPER, 4, timeout=8)
    assert job.timed_out, job.output
    assert sorted(job.running_at_timeout) == ["hvdnode1", "hvdnode2"], job.output
    assert not job.leftovers and not host_bed.running(), "processes survived the timeout"
