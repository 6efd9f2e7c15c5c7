"""``hvdlite run -p/--ssh-port -i/--ssh-identity-file`` and the host check, without MPI jobs.

How each launcher gets ssh's arguments is written down from the launchers' sources and docs:
MPICH's Hydra reads HYDRA_LAUNCHER_EXTRA_ARGS and splits it on spaces
(src/pm/hydra/lib/tools/bootstrap/external/external_common_launch.c, and it has no
-bootstrap-exec-args option: "unrecognized argument"); Intel MPI takes ``-bootstrap ssh
-bootstrap-exec-args ARGS`` (its mpiexec.hydra manual; Horovod's mpi_run.py passes the same);
Open MPI takes ``--mca plm_rsh_args ARGS`` (Horovod's mpi_run.py).  The host check runs a fake
ssh (a script) so every outcome can be produced here; tests/multihost runs it through Hydra.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from hvdlite.runner import host_check, launch, mpi_flavor
from hvdlite.runner.mpi_flavor import INTEL_MPI, MPICH, OPEN_MPI, JobSpec, MpiFlavor
from tests.unit.runner.test_launch import MPICH_VERSION, OMPI4_VERSION, _executable, _fake_launcher

HYDRA = MpiFlavor(MPICH, (5, 0, 2))
INTEL = MpiFlavor(INTEL_MPI, (2021, 10))
OMPI = MpiFlavor(OPEN_MPI, (4, 1, 2))
OPERATOR_ARGS = "-o ConnectionAttempts=10"   # what the Kubeflow MPI Operator sets


def _job(ssh_args=None, mpi_args=()) -> JobSpec:
    return JobSpec(np=2, command=["cmd"], ssh_args=ssh_args, mpi_args=list(mpi_args))


# --- passing -p/-i to each launcher ---------------------------------------------------------------
def test_parse_ssh_flags(tmp_path, monkeypatch):
    key = tmp_path / "id_test"
    key.write_text("key\n")
    monkeypatch.chdir(tmp_path)
    for argv in (["-p", "2222", "-i", "id_test"],
                 ["--ssh-port", "2222", "--ssh-identity-file", str(key)],
                 ["--ssh-port=2222", "--ssh-identity-file=id_test"]):
        args = launch.parse_args(argv + ["-np", "2", "cmd"])
        assert launch.ssh_options(args) == ["-p", "2222", "-i", str(key)], argv
    assert launch.ssh_options(launch.parse_args(["-np", "2", "cmd"])) == []


@pytest.mark.parametrize("value", ["0", "65536", "ssh"])
def test_bad_port_is_a_usage_error(value, capsys):
    assert launch.main(["-p", value, "-np", "2", "cmd"]) == 2
    assert "-p/--ssh-port" in capsys.readouterr().err


def test_missing_identity_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert launch.main(["-i", str(missing), "-np", "2", "cmd"]) == 2
    err = capsys.readouterr().err
    assert f"-i/--ssh-identity-file {missing}: no such file" in err


def test_identity_file_with_a_blank_is_refused(tmp_path, monkeypatch, capsys):
    key = tmp_path / "my key"
    key.write_text("key\n")
    monkeypatch.setattr(launch, "detect_launcher", lambda explicit: ("mpiexec", HYDRA))
    assert launch.main(["-i", str(key), "-np", "2", "cmd"]) == 2
    assert "splits its ssh arguments on blanks" in capsys.readouterr().err


@pytest.mark.parametrize("flavor, mpi_args", [
    (INTEL, "--mpi-args=-bootstrap-exec-args -q"), (OMPI, "--mpi-args=--mca plm_rsh_args -q")])
def test_ssh_arguments_in_two_places_are_refused(flavor, mpi_args, monkeypatch, capsys):
    monkeypatch.setattr(launch, "detect_launcher", lambda explicit: ("mpiexec", flavor))
    assert launch.main(["-p", "2222", mpi_args, "-np", "2", "cmd"]) == 2
    assert "both set the launcher's ssh arguments" in capsys.readouterr().err


def test_ssh_arguments_follow_what_the_environment_already_gives():
    options = ["-p", "2222", "-i", "/k"]
    for flavor, variable in ((HYDRA, "HYDRA_LAUNCHER_EXTRA_ARGS"),
                             (INTEL, "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS"),
                             (OMPI, "OMPI_MCA_plm_rsh_args")):
        assert mpi_flavor.ssh_arguments(flavor, options, {}) == "-p 2222 -i /k"
        assert (mpi_flavor.ssh_arguments(flavor, options, {variable: OPERATOR_ARGS})
                == "-o ConnectionAttempts=10 -p 2222 -i /k")
        assert mpi_flavor.ssh_arguments(flavor, [], {variable: OPERATOR_ARGS}) is None


def test_mpich_gets_ssh_arguments_through_its_variable():
    job = _job("-p 2222 -i /k")
    assert mpi_flavor.build_command("mpiexec", HYDRA, job) == [
        "mpiexec", "-n", "2", "-launcher", "ssh", "cmd"]
    assert mpi_flavor.launcher_environment(HYDRA, job) == {
        "HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222 -i /k"}
    # a launcher named in --mpi-args stays the user's choice
    chosen = _job("-p 2222", ["-launcher", "rsh"])
    assert mpi_flavor.build_command("mpiexec", HYDRA, chosen) == [
        "mpiexec", "-n", "2", "-launcher", "rsh", "cmd"]
    assert mpi_flavor.build_command("mpiexec", HYDRA, _job()) == ["mpiexec", "-n", "2", "cmd"]
    assert mpi_flavor.launcher_environment(HYDRA, _job()) == {}


def test_intel_mpi_gets_ssh_arguments_as_options():
    argv = mpi_flavor.build_command("mpiexec", INTEL, _job("-p 2222 -i /k"))
    assert argv == ["mpiexec", "-n", "2", "-bootstrap", "ssh", "-bootstrap-exec-args",
                    "-p 2222 -i /k", "cmd"]
    assert mpi_flavor.launcher_environment(INTEL, _job("-p 2222")) == {}


def test_open_mpi_gets_ssh_arguments_as_plm_rsh_args():
    argv = mpi_flavor.build_command("mpirun", OMPI, _job("-o ConnectionAttempts=10 -p 2222"))
    at = argv.index("plm_rsh_args")
    assert argv[at - 1:at + 2] == ["--mca", "plm_rsh_args", "-o ConnectionAttempts=10 -p 2222"]
    assert "plm_rsh_args" not in mpi_flavor.build_command("mpirun", OMPI, _job())


def test_one_network_interface_also_sets_libfabric_tcp():
    args = launch.parse_args(["-np", "2", "--network-interface", "eth1", "cmd"])
    env = launch.job_env(args, {})
    assert env == {"NCCL_SOCKET_IFNAME": "eth1", "FI_TCP_IFACE": "eth1"}
    several = launch.parse_args(["-np", "2", "--network-interfaces", "eth1,ib0", "cmd"])
    assert launch.job_env(several, {}) == {"NCCL_SOCKET_IFNAME": "eth1,ib0"}
    mine = launch.parse_args(["-np", "2", "-x", "FI_TCP_IFACE=lo", "--network-interface", "eth1",
                              "cmd"])
    assert launch.job_env(mine, {})["FI_TCP_IFACE"] == "lo"


# --- which ssh the launcher will use ------------------------------------------------------------
@pytest.mark.parametrize("flavor, mpi_args, environ, ssh_args, expected", [
    (HYDRA, [], {}, None, ["ssh"]),
    (HYDRA, [], {}, "-p 2222", ["ssh", "-p", "2222"]),
    (HYDRA, [], {"HYDRA_LAUNCHER_EXTRA_ARGS": "-o A=1"}, None, ["ssh", "-o", "A=1"]),
    (HYDRA, [], {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": "/bed/ssh"}, None, ["/bed/ssh"]),
    (HYDRA, ["-launcher-exec", "/x/ssh"], {"HYDRA_LAUNCHER_EXEC": "/bed/ssh"}, None,
     ["/x/ssh"]),
    (HYDRA, [], {"HYDRA_LAUNCHER": "slurm"}, None, None),
    (HYDRA, ["-launcher", "fork"], {}, "-p 2222", None),
    (HYDRA, [], {"SLURM_JOB_ID": "7"}, None, None),             # srun starts the proxies
    (HYDRA, [], {"SLURM_JOB_ID": "7"}, "-p 2222", ["ssh", "-p", "2222"]),   # -p means ssh
    (HYDRA, [], {"HYDRA_LAUNCH_EXTRA_ARGS": "-o A=1"}, None, ["ssh"]),   # not Hydra's name
    (INTEL, [], {"I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS": "-o A=1"}, None, ["ssh", "-o", "A=1"]),
    (INTEL, ["-bootstrap-exec-args", "-q"], {}, None, ["ssh", "-q"]),
    (INTEL, [], {"I_MPI_HYDRA_BOOTSTRAP": "lsf"}, None, None),
    (OMPI, [], {}, None, ["ssh"]),
    (OMPI, [], {"OMPI_MCA_plm_rsh_agent": "ssh : rsh"}, None, ["ssh"]),
    (OMPI, [], {"OMPI_MCA_plm_rsh_args": "-o A=1"}, "-o A=1 -p 2", ["ssh", "-o", "A=1", "-p", "2"]),
    (OMPI, ["--mca", "plm_rsh_agent", "/x/ssh -q"], {}, None, ["/x/ssh", "-q"]),
    (OMPI, ["-mca", "plm", "slurm"], {}, None, None),
    (OMPI, [], {"PBS_JOBID": "1"}, None, None),
])
def test_remote_shell(flavor, mpi_args, environ, ssh_args, expected):
    assert host_check.remote_shell(flavor, mpi_args, environ, ssh_args) == expected


def test_remote_hosts_leave_this_machine_out():
    here = socket.gethostname()
    names = ["localhost", here, "127.0.0.1", "hvdlite-test-host.invalid", "other.invalid",
             "hvdlite-test-host.invalid"]
    names += sorted(host_check._interface_addresses())
    assert host_check.remote_hosts(names) == ["hvdlite-test-host.invalid", "other.invalid"]
    assert "127.0.0.1" in host_check.local_names() and here in host_check.local_names()


# --- the check itself ---------------------------------------------------------------------------
FAKE_SSH = """#!/bin/sh
# $1 $2: -p PORT (always given here); $3: host; $4: the remote command
echo "$*" >> "{log}"
case "$3" in
  typo) echo "ssh: Could not resolve hostname typo: Name or service not known" >&2; exit 255 ;;
  locked) echo "mpiuser@locked: Permission denied (publickey)." >&2; exit 255 ;;
  silent) sleep 30 ;;
  noproxy) exit 1 ;;
  late) n=$(cat "{count}" 2>/dev/null || echo 0); echo $((n + 1)) > "{count}"
        [ "$n" -ge 1 ] || {{ echo "ssh: Could not resolve hostname late" >&2; exit 255; }} ;;
esac
exit 0
"""


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    monkeypatch.setattr(host_check, "RETRY_PAUSE", 0.05)
    log = tmp_path / "ssh.log"
    script = FAKE_SSH.format(log=log, count=tmp_path / "late.count")
    return _executable(tmp_path / "ssh", script), log


def test_check_names_each_host_that_fails_and_retries(fake_ssh):
    ssh, log = fake_ssh
    hosts = ["good", "typo", "late", "locked", "noproxy", "silent"]
    started = time.monotonic()
    problems = host_check.check(hosts, [str(ssh), "-p", "2222"], "test -x /v/hydra_pmi_proxy",
                                timeout=2.0)
    took = time.monotonic() - started
    assert took < 6, f"the check must end at its deadline (took {took:.1f} s)"
    assert [(p.host, p.status) for p in problems] == [
        ("typo", 255), ("locked", 255), ("noproxy", 1), ("silent", None)]
    assert "Could not resolve hostname typo" in problems[0].output
    calls = log.read_text().splitlines()
    assert calls.count("-p 2222 typo test -x /v/hydra_pmi_proxy") == host_check.ATTEMPTS
    assert calls.count("-p 2222 late test -x /v/hydra_pmi_proxy") == 2   # failed once, then in
    assert calls.count("-p 2222 good test -x /v/hydra_pmi_proxy") == 1
    message = host_check.describe(problems, len(hosts), [str(ssh), "-p", "2222"],
                                  "test -x /v/hydra_pmi_proxy", "/v/hydra_pmi_proxy", 2.0)
    lines = message.splitlines()
    assert lines[0].startswith(f"4 of 6 remote host(s) cannot be reached the way the MPI "
                               f"launcher reaches them ({ssh} -p 2222 HOST 'test -x")
    assert lines[1] == ("  typo: exit status 255: ssh: Could not resolve hostname typo: Name "
                        "or service not known")
    assert lines[2] == "  locked: exit status 255: mpiuser@locked: Permission denied (publickey)."
    assert lines[3] == ("  noproxy: logged in, but /v/hydra_pmi_proxy is not there: install the "
                        "same Python environment at the same path on every host")
    assert lines[4] == "  silent: no answer within 2 s"
    assert "--skip-host-check" in lines[5] and "-p/--ssh-port" in lines[5]


def test_start_timeout_bounds_the_check(tmp_path, fake_ssh, monkeypatch, capsys):
    ssh, log = fake_ssh
    fake, record = _fake_launcher(tmp_path, MPICH_VERSION)
    monkeypatch.setenv("HYDRA_LAUNCHER_EXEC", str(ssh))
    for name in ("HYDRA_LAUNCHER", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE",
                 "HYDRA_HOST_FILE"):
        monkeypatch.delenv(name, raising=False)
    started = time.monotonic()
    code = launch.main(["--mpiexec", str(fake), "-p", "2222", "--start-timeout", "1.5",
                        "-H", "good:1,silent:1", "cmd"])
    took = time.monotonic() - started
    assert code == 1 and not record.exists() and took < 5, took
    assert "  silent: no answer within 1.5 s" in capsys.readouterr().err


def test_check_of_an_ssh_that_does_not_exist(tmp_path):
    problems = host_check.check(["h1"], [str(tmp_path / "no-ssh")], timeout=5)
    assert problems == [host_check.Unreachable(
        "h1", 127, f"cannot run {tmp_path / 'no-ssh'}: No such file or directory")]


def test_probe_tests_hydras_proxy_only_where_it_is(tmp_path):
    mpiexec = _executable(tmp_path / "mpiexec")
    assert host_check.probe_command(HYDRA, str(mpiexec)) == ("true", None)
    proxy = _executable(tmp_path / "hydra_pmi_proxy")
    assert host_check.probe_command(HYDRA, str(mpiexec)) == (f"test -x {proxy}", str(proxy))
    assert host_check.probe_command(OMPI, str(mpiexec)) == ("true", None)


# --- through hvdlite run, with a fake launcher and a fake ssh -----------------------------------
def test_unreachable_host_stops_the_launch_before_the_launcher(tmp_path, fake_ssh, monkeypatch,
                                                               capsys):
    ssh, log = fake_ssh
    fake, record = _fake_launcher(tmp_path, MPICH_VERSION)
    monkeypatch.setenv("HYDRA_LAUNCHER_EXEC", str(ssh))
    for name in ("HYDRA_LAUNCHER", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE",
                 "HYDRA_HOST_FILE"):
        monkeypatch.delenv(name, raising=False)
    code = launch.main(["--mpiexec", str(fake), "-p", "2222", "-H", "good:1,typo:1", "cmd"])
    err = capsys.readouterr().err
    assert code == 1 and not record.exists(), err
    assert "hvdlite: error: 1 of 2 remote host(s)" in err and "  typo: exit status 255" in err
    # skipped on request: the launcher starts, with the ssh arguments in Hydra's variable
    assert launch.main(["--mpiexec", str(fake), "-p", "2222", "--skip-host-check",
                        "-H", "good:1,typo:1", "cmd"]) == 0
    seen = json.loads(record.read_text())
    assert seen["argv"][1:] == ["-n", "2", "-hosts", "good:1,typo:1", "-launcher", "ssh", "cmd"]
    assert seen["env"]["HYDRA_LAUNCHER_EXTRA_ARGS"] == "-p 2222"


def test_the_launchers_hostfile_variable_gives_np_and_the_hosts(tmp_path, fake_ssh, monkeypatch,
                                                                capsys):
    """Under the Kubeflow MPI Operator: no -np, no -H; the hosts are in HYDRA_HOST_FILE, which
    Hydra reads itself (so hvdlite passes no -f)."""
    ssh, log = fake_ssh
    fake, record = _fake_launcher(tmp_path, MPICH_VERSION)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("good:2\nlate:2\n")
    monkeypatch.setenv("HYDRA_HOST_FILE", str(hostfile))
    monkeypatch.setenv("HYDRA_LAUNCHER_EXEC", str(ssh))
    monkeypatch.setenv("HYDRA_LAUNCHER_EXTRA_ARGS", "-p 2222")
    for name in ("HYDRA_LAUNCHER", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)
    assert launch.main(["--mpiexec", str(fake), "cmd"]) == 0, capsys.readouterr().err
    assert json.loads(record.read_text())["argv"][1:] == ["-n", "4", "cmd"]
    assert sorted(set(log.read_text().split("\n")) - {""}) == [
        "-p 2222 good true", "-p 2222 late true"]
    hostfile.write_text("good:1\ntypo:1\n")
    assert launch.main(["--mpiexec", str(fake), "-np", "2", "cmd"]) == 1
    assert "typo: exit status 255" in capsys.readouterr().err
    hostfile.unlink()
    assert launch.main(["--mpiexec", str(fake), "cmd"]) == 1
    assert f"cannot read the hostfile HYDRA_HOST_FILE={hostfile}" in capsys.readouterr().err


def test_open_mpi_check_uses_its_agent_and_arguments(tmp_path, fake_ssh, monkeypatch, capsys):
    ssh, log = fake_ssh
    fake, record = _fake_launcher(tmp_path, OMPI4_VERSION)
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", str(ssh))
    monkeypatch.setenv("OMPI_MCA_plm_rsh_args", "-p 2222")
    for name in ("OMPI_MCA_plm", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "PE_HOSTFILE",
                 "HYDRA_HOST_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert launch.main(["--mpiexec", str(fake), "-H", "good:1,locked:1", "cmd"]) == 1
    assert "locked: exit status 255: mpiuser@locked: Permission denied" in (
        capsys.readouterr().err)
    assert "-p 2222 locked true" in log.read_text()
