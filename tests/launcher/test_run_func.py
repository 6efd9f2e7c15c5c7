"""hvdlite.run(func, ...) (Horovod's horovod.run): real jobs at 2 and 3 ranks started from a
driver process the way a notebook would call it (tests/launcher/workers/run_func_driver.py), and the
pure logic that maps its arguments onto the launcher and turns the ranks' reports into results."""
import json
import os
import signal
import subprocess
import sys

import pytest

from hvdlite.runner import function_runner as fr
from tests.mpi_harness import TESTS, base_env

TIMEOUT = 90


def drive(mode: str, np_: int) -> dict:
    """Run the driver in its own process group; on timeout SIGTERM it (it forwards that to
    its MPI job), then kill it, and fail with its output."""
    driver = TESTS / "launcher/workers/run_func_driver.py"
    proc = subprocess.Popen([sys.executable, str(driver), mode, str(np_)], env=base_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"hvdlite.run() hung\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, f"{stdout}\n{stderr}"
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("np_", [2, 3])
def test_returns_every_ranks_value_in_rank_order(np_):
    got = drive("collectives", np_)
    assert "error" not in got, got
    summed = [k * 3 * sum(r + 1 for r in range(np_)) for k in range(4)]
    gathered = [r for r in range(np_) for _ in range(r + 1)]
    assert got["value"] == [[r, np_, summed, gathered, 7] for r in range(np_)]
    # the ranks' output reaches the caller's sys.stdout (a notebook cell), not only fd 1
    for r in range(np_):
        assert f"hello from rank {r}" in got["stdout"], got


@pytest.mark.parametrize("np_", [2, 3])
def test_lambda_and_deprecated_np(np_):
    got = drive("lambda_np_alias", np_)
    assert got["value"] == [42] * np_, got
    assert "np is deprecated, use num_proc instead" in got["stderr"]


@pytest.mark.parametrize("np_", [2, 3])
def test_exception_on_one_rank_names_it_and_is_the_cause(np_):
    got = drive("raises", np_)
    assert got["error"] == "RuntimeError", got
    last = np_ - 1
    # the other ranks failed only because the last one left; the root cause is reported
    assert f"func raised on rank(s) {list(range(np_))}; rank {last}'s traceback" in \
        got["message"], got["message"]
    assert "KeyError: 'missing shard on the last rank'" in got["message"]
    assert "raise_on_last_rank" in got["message"]
    assert got["cause"] == ["KeyError", "'missing shard on the last rank'"]


def test_unpicklable_return_value_is_a_clear_error():
    got = drive("unpicklable_result", 2)
    assert got["error"] == "RuntimeError", got
    assert "the return value of func on rank 0 cannot be pickled (lock)" in got["message"]
    assert got["cause"][0] == "TypeError"


def test_rank_that_leaves_without_returning_is_reported():
    got = drive("exit_early", 2)
    assert got["error"] == "RuntimeError", got
    assert "rank(s) [1] returned nothing" in got["message"], got["message"]


@pytest.mark.parametrize("mode, error, fragment", [
    ("use_gloo", "ValueError", "--gloo (a horovodrun flag) is not supported"),
    ("elastic_without_hosts", "ValueError", "an elastic job (--min-np/--max-np) needs its hosts"),
    ("hosts_and_hostfile", "ValueError", "give hosts or hostfile, not both"),
    ("not_callable", "TypeError", "func must be callable, got str"),
])
def test_refused_arguments(mode, error, fragment):
    got = drive(mode, 2)
    assert got["error"] == error and fragment in got["message"], got


# --- pure logic ----------------------------------------------------------------------------
def argv_for(**overrides):
    names = ["num_proc", "min_num_proc", "max_num_proc", "slots", "reset_limit",
             "cooldown_range", "hosts", "hostfile", "start_timeout", "ssh_port",
             "ssh_identity_file", "disable_cache", "output_filename", "verbose", "use_gloo",
             "use_mpi", "mpi_args", "network_interface", "executable"]
    values = dict.fromkeys(names)
    values["num_proc"] = 2
    values.update(overrides)
    return fr._launcher_argv(**values)


def test_launcher_argv_defaults():
    assert argv_for() == ["-np", "2", sys.executable, "-m", "hvdlite.runner.task"]


def test_launcher_argv_maps_every_supported_argument():
    argv = argv_for(num_proc=4, hosts="h1:2,h2:2", start_timeout=30, output_filename="logs",
                    network_interface="eth0", disable_cache=True, verbose=True, use_mpi=True,
                    mpi_args="-bind-to core", executable="/opt/py/bin/python")
    assert argv == ["-np", "4", "-H", "h1:2,h2:2", "--start-timeout", "30",
                    "--output-filename", "logs", "--network-interface", "eth0",
                    "--disable-cache", "--verbose", "--mpi", "--mpi-args=-bind-to core",
                    "/opt/py/bin/python", "-m", "hvdlite.runner.task"]
    parsed = fr._parse(argv)
    assert (parsed.np, parsed.hosts, parsed.nics, parsed.mpi_args, parsed.verbose) == (
        4, "h1:2,h2:2", ["eth0"], "-bind-to core", True)
    assert parsed.command == ["/opt/py/bin/python", "-m", "hvdlite.runner.task"]


def test_ssh_arguments_reach_the_launcher():
    argv = argv_for(hosts="h1:2,h2:2", ssh_port=2222, ssh_identity_file="/keys/id")
    assert argv[:8] == ["-np", "2", "-H", "h1:2,h2:2", "-p", "2222", "-i", "/keys/id"]
    parsed = fr._parse(argv)
    assert (parsed.ssh_port, parsed.ssh_identity_file) == (2222, "/keys/id")
    with pytest.raises(ValueError, match="-p/--ssh-port: a port is 1-65535, got 0"):
        fr._parse(argv_for(ssh_port=0))


def test_ssh_arguments_do_not_matter_for_a_job_on_this_host():
    got = drive("ssh_port", 2)
    assert got.get("value") == ["no ssh needed"] * 2, got


def test_elastic_arguments_map_onto_the_elastic_flags():
    argv = argv_for(num_proc=2, min_num_proc=1, max_num_proc=4, slots=2, reset_limit=3,
                    cooldown_range=(5, 60), hosts="h1:2,h2:2")
    parsed = fr._parse(argv)
    assert (parsed.np, parsed.min_np, parsed.max_np, parsed.slots_per_host, parsed.reset_limit,
            parsed.cooldown_range, parsed.hosts) == (2, 1, 4, 2, 3, [5, 60], "h1:2,h2:2")


def test_elastic_job_returns_the_last_worlds_values():
    """Rank 1 of the first world exits with status 3 after step 4 (whose gradients it had
    already averaged with rank 0): its host is blacklisted, and the second world (one rank)
    resumes from rank 0's commit of step 4; hvdlite.run returns that world's values."""
    got = drive("elastic", 2)
    assert "error" not in got, got
    assert got["value"] == [[1, 0, 1, 4, 10]], got
    assert "world 1: 1 rank(s)" in got["stderr"], got["stderr"][-2000:]


def test_collect_orders_results_by_rank():
    import cloudpickle
    results = {1: (True, cloudpickle.dumps("b")), 0: (True, cloudpickle.dumps("a"))}
    assert fr.collect_results(results, 2, 0) == ["a", "b"]


def test_collect_prefers_the_root_cause_over_ranks_that_saw_a_peer_leave():
    import cloudpickle
    from hvdlite.common.errors import RankExitedError
    results = {0: (False, ("tb0 RankExitedError", cloudpickle.dumps(RankExitedError("gone")))),
               1: (False, ("tb1 ValueError", cloudpickle.dumps(ValueError("bad")))),
               2: (False, ("tb2 RankExitedError", None))}
    with pytest.raises(RuntimeError) as info:
        fr.collect_results(results, 3, 1)
    assert "rank(s) [0, 1, 2]; rank 1's traceback:\ntb1 ValueError" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def test_collect_reports_missing_ranks_even_when_the_job_exited_0():
    import cloudpickle
    with pytest.raises(RuntimeError, match=r"exited with status 0.*\n.*rank\(s\) \[1\]"):
        fr.collect_results({0: (True, cloudpickle.dumps(1))}, 2, 0)


def test_listen_address_passes_over_a_host_that_does_not_resolve():
    """A job whose host list names an unknown host must reach the launcher's host check
    (which names it) rather than fail in the driver with socket.gaierror."""
    from hvdlite.runner.mpi_flavor import Host
    assert fr._listen_address(None) == ("127.0.0.1", "127.0.0.1")
    assert fr._listen_address([Host("localhost", 2)]) == ("127.0.0.1", "127.0.0.1")
    bind, advertised = fr._listen_address([Host("hvdlite-no-such-host.invalid", 1)])
    assert bind == "0.0.0.0" and advertised
