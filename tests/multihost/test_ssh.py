"""``hvdlite run``'s ssh options and host check across simulated hosts (issue 35, item 4).

The hosts of ``operator_bed`` take ssh logins on port 2222 only, as the Kubernetes example's
pods do, so ``-p`` must reach every ssh that Hydra starts; the stand-in logs each call's
arguments.  The session's ``host_bed`` (port 22) serves the hosts that cannot be reached: a name
no hosts file knows, and a host whose sshd refuses the key.
"""
import json
import sys

from tests.mpi_harness import TESTS
from tests.multihost.hosts import HostBed, check_host_job

RUN_FUNC_DRIVER = str(TESTS / "launcher/workers/run_func_driver.py")

TIMEOUT = 120
HVDLITE_RUN = [sys.executable, "-m", "hvdlite.runner", "run"]
# One allreduce across the hosts; each rank writes one line (Hydra merges output by write).
PROBE = [sys.executable, "-c", (
    "import json, os, socket, numpy as np, hvdlite as hvd\n"
    "hvd.init()\n"
    "total = hvd.allreduce(np.ones(3) * (hvd.rank() + 1), op=hvd.Sum)\n"
    "line = [hvd.rank(), socket.gethostname(), os.environ.get('NCCL_SOCKET_IFNAME'),\n"
    "        os.environ.get('FI_TCP_IFACE'), total.tolist()]\n"
    "os.write(1, ('RANK ' + json.dumps(line) + '\\n').encode())\n"
    "hvd.shutdown()\n")]


def _mark(bed: HostBed) -> int:
    log = bed.root / "standin.log"
    return log.stat().st_size if log.exists() else 0


def _calls(bed: HostBed, since: int) -> tuple[list[list[str]], list[list[str]]]:
    """The stand-in's calls since ``since``: (host checks, Hydra's proxy launches)."""
    with open(bed.root / "standin.log") as f:
        f.seek(since)
        calls = [json.loads(line)["argv"] for line in f]
    hydra = [call for call in calls if any(word.endswith('hydra_pmi_proxy"') for word in call)]
    return [call for call in calls if call not in hydra], hydra


def _key(bed: HostBed) -> str:
    key = bed.root / "jobs" / "id_cluster"   # the stand-in takes -i FILE without reading it
    key.write_text("not really a key\n")
    return str(key)


def test_ssh_port_identity_file_and_interface_reach_every_host(operator_bed):
    """``--hostfile`` with ``-p``/``-i`` and ``--network-interface lo``: the check and every
    ssh Hydra starts get ``-p 2222 -i KEY``; Hydra's own connections use lo's address
    (``-iface``), and the ranks see NCCL_SOCKET_IFNAME and FI_TCP_IFACE."""
    first, second = operator_bed.names
    hostfile = operator_bed.root / "jobs" / "hostfile-ssh"
    hostfile.write_text(f"{first} slots=2\n{second} slots=2\n")
    key, since = _key(operator_bed), _mark(operator_bed)
    job = operator_bed.run(HVDLITE_RUN + ["--hostfile", str(hostfile), "-p", "2222", "-i", key,
                                          "--network-interface", "lo"] + PROBE, 0,
                           timeout=TIMEOUT)
    check_host_job(job, 0)
    lines = sorted(json.loads(line[len("RANK "):]) for line in job.stdout.splitlines()
                   if line.startswith("RANK "))
    assert lines == [[rank, host, "lo", "lo", [10.0, 10.0, 10.0]] for rank, host
                     in enumerate([first, first, second, second])], job.output
    checks, hydra = _calls(operator_bed, since)
    assert sorted(call[:5] for call in checks) == [["-p", "2222", "-i", key, host]
                                                   for host in (first, second)]
    assert all(call[5].startswith("test -x ") for call in checks), checks
    assert sorted(call[:6] for call in hydra) == [["-x", "-p", "2222", "-i", key, host]
                                                  for host in (first, second)]
    for call in hydra:
        assert call[call.index("--control-port") + 1].startswith("127.0.0.1:"), call
        assert call[call.index("--iface") + 1] == "lo", call


def test_run_function_with_ssh_options(operator_bed):
    """``hvdlite.run(func, hosts=..., ssh_port=, ssh_identity_file=, network_interface=)``."""
    first, second = operator_bed.names
    key = _key(operator_bed)
    job = operator_bed.run([sys.executable, RUN_FUNC_DRIVER, "on_hosts_ssh",
                            "3", f"{first}:1,{second}:2", "2222", key, "lo"], 0,
                           timeout=TIMEOUT)
    check_host_job(job, 0)
    lines = [line for line in job.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, job.output
    got = json.loads(lines[0][len("RESULT "):])
    assert "error" not in got, got
    summed = [k * 5 * (1 + 2 + 3) for k in range(3)]
    # (rank, size, local_rank, local_size, cross_rank, cross_size, host, sum, NCCL, FI_TCP)
    assert got["value"] == [[0, 3, 0, 1, 0, 2, first, summed, "lo", "lo"],
                            [1, 3, 0, 2, 1, 2, second, summed, "lo", "lo"],
                            [2, 3, 1, 2, 0, 1, second, summed, "lo", "lo"]]


def test_wrong_port_is_named_before_anything_starts(operator_bed):
    """Without ``-p`` ssh goes to port 22, which these hosts refuse: hvdlite run names both
    hosts and stops before Hydra starts anything.  With ``--skip-host-check`` Hydra fails in
    its own words, which name no host."""
    first, second = operator_bed.names
    hosts = f"{first}:1,{second}:1"
    since = _mark(operator_bed)
    job = operator_bed.run(HVDLITE_RUN + ["-H", hosts] + PROBE, 0, timeout=TIMEOUT)
    assert job.returncode == 1 and not job.leftovers, job.output
    assert "hvdlite: error: 2 of 2 remote host(s) cannot be reached" in job.stderr
    for host in (first, second):
        assert (f"  {host}: exit status 255: ssh: connect to host {host} port 22: Connection "
                f"refused") in job.stderr, job.stderr
    checks, hydra = _calls(operator_bed, since)
    assert not hydra and len(checks) >= 2, "nothing may be launched after the check failed"
    skipped = operator_bed.run(HVDLITE_RUN + ["--skip-host-check", "-H", hosts] + PROBE, 0,
                               timeout=TIMEOUT)
    assert skipped.returncode == 255 and not skipped.leftovers, skipped.output
    assert "Launch proxy failed" in skipped.stderr and "remote host(s)" not in skipped.stderr


def test_unknown_and_refusing_hosts_are_named(host_bed):
    """A name the hosts file does not know and a host whose sshd refuses the key, in one
    launch; the host that works is not mentioned.  hvdlite.run() raises with the same text."""
    hosts = "hvdnode1:1,hvdnode9:1,hvdnode2:1"
    refusal = "root@hvdnode2: Permission denied (publickey)."
    with host_bed.refusing("hvdnode2", refusal):
        since = _mark(host_bed)
        job = host_bed.run(HVDLITE_RUN + ["-H", hosts] + PROBE, 0, timeout=TIMEOUT)
        driver = host_bed.run([sys.executable, RUN_FUNC_DRIVER, "on_hosts",
                               "3", hosts], 0, timeout=TIMEOUT)
    assert job.returncode == 1 and not job.leftovers, job.output
    lines = job.stderr.splitlines()
    assert lines[0].startswith("hvdlite: error: 2 of 3 remote host(s) cannot be reached")
    assert lines[1] == ("  hvdnode9: exit status 255: ssh: Could not resolve hostname hvdnode9: "
                        "Name or service not known")
    assert lines[2] == f"  hvdnode2: exit status 255: {refusal}"
    assert lines[3].startswith("Check first: ") and "hvdnode1" not in job.stderr
    assert not _calls(host_bed, since)[1], "nothing may be launched after the check failed"
    got = json.loads(next(line for line in driver.stdout.splitlines()
                          if line.startswith("RESULT "))[len("RESULT "):])
    assert got["error"] == "RuntimeError", got
    assert got["message"].startswith("hvdlite.run(): 2 of 3 remote host(s) cannot be reached")
    assert "  hvdnode9: " in got["message"] and f"  hvdnode2: exit status 255: {refusal}" in (
        got["message"])
