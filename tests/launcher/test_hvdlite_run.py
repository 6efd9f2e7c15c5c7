"""Real ``hvdlite run`` launches with the MPICH from the virtual environment.

Each launch runs ``python -m hvdlite.runner ...`` in a new process group with a timeout that
kills the whole group, so a hung job fails the test instead of the CI.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpi_harness import REPO, base_env

VENV_BIN = str(Path(sys.executable).parent)
KNOBS = ("HVDLITE_FUSION_THRESHOLD", "HVDLITE_CYCLE_TIME", "HVDLITE_STALL_CHECK_DISABLE",
         "HVDLITE_LOG_LEVEL", "FOO", "PASSED")

# Every rank prints "rank size" and a "PROBE {json}" line (its topology, the variables it sees,
# its Python, the fusion threshold the engine parsed) in a single write, so that the ranks'
# output, which mpiexec forwards chunk by chunk, cannot interleave inside a line.
PROBE = (
    "import json, os, sys, hvdlite as hvd\n"
    "from hvdlite.common.config import Config\n"
    "hvd.init()\n"
    "report = {'rank': hvd.rank(), 'size': hvd.size(), 'exe': sys.executable,"
    " 'fusion': Config.from_env().fusion_threshold,"
    f" 'env': {{k: os.environ.get(k) for k in {KNOBS!r}}}}}\n"
    "sys.stdout.write(f'{hvd.rank()} {hvd.size()}\\nPROBE {json.dumps(report)}\\n')\n"
    "sys.stdout.flush()\n"
)


def run_cli(args: list[str], timeout: float = 60, env: dict | None = None,
            cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``python -m hvdlite.runner <args>`` in its own process group; kill it on timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "hvdlite.runner"] + args, cwd=cwd,
                            env=env or base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"hvdlite run timed out\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def probes(result: subprocess.CompletedProcess) -> list[dict]:
    """The ranks' PROBE reports, in rank order."""
    reports = [json.loads(line[len("PROBE "):]) for line in result.stdout.splitlines()
               if line.startswith("PROBE ")]
    return sorted(reports, key=lambda report: report["rank"])


def _output(result: subprocess.CompletedProcess) -> str:
    return (f"rc={result.returncode}\n--- stdout ---\n{result.stdout}\n"
            f"--- stderr ---\n{result.stderr}")


def _without_venv_on_path(env: dict) -> dict:
    env["PATH"] = os.pathsep.join(entry for entry in env["PATH"].split(os.pathsep)
                                  if entry and entry != VENV_BIN)
    return env


def test_two_ranks_with_knobs_and_x():
    # The venv's bin is removed from PATH: hvdlite must find its mpiexec next to sys.executable
    # and put that directory first on the ranks' PATH so that plain `python` is the venv's.
    env = _without_venv_on_path(base_env({"PASSED": "from-launcher"}))
    result = run_cli(["run", "-np", "2", "--fusion-threshold-mb", "1", "--cycle-time-ms", "2",
                      "--no-stall-check", "--log-level", "warning", "-x", "FOO=bar",
                      "-x", "PASSED", "--verbose", "python", "-c", PROBE], env=env)
    assert result.returncode == 0, _output(result)
    reports = probes(result)
    assert [(r["rank"], r["size"]) for r in reports] == [(0, 2), (1, 2)], _output(result)
    for report in reports:
        assert report["env"] == {"HVDLITE_FUSION_THRESHOLD": "1048576", "HVDLITE_CYCLE_TIME": "2",
                                 "HVDLITE_STALL_CHECK_DISABLE": "1", "HVDLITE_LOG_LEVEL": "WARNING",
                                 "FOO": "bar", "PASSED": "from-launcher"}
        assert report["fusion"] == 1048576
        assert Path(report["exe"]).parent == Path(VENV_BIN)
    assert sorted(line for line in result.stdout.splitlines()
                  if not line.startswith("PROBE ")) == ["0 2", "1 2"]
    assert f"{VENV_BIN}/mpiexec -n 2 " in result.stderr  # --verbose shows the command
    assert "-genv HVDLITE_FUSION_THRESHOLD 1048576" in result.stderr


def test_three_ranks_from_hostfile_slots(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# Open MPI style; hvdlite rewrites it for MPICH\nlocalhost slots=3\n")
    result = run_cli(["run", "--hostfile", str(hostfile), sys.executable, "-c", PROBE])
    assert result.returncode == 0, _output(result)
    assert [(r["rank"], r["size"]) for r in probes(result)] == [(0, 3), (1, 3), (2, 3)]


def test_host_list_without_run_word():
    result = run_cli(["-np", "2", "-H", "localhost:2", sys.executable, "-c", PROBE])
    assert result.returncode == 0, _output(result)
    assert [(r["rank"], r["size"]) for r in probes(result)] == [(0, 2), (1, 2)]


def test_timeline_filename_records_on_rank_zero(tmp_path):
    # a relative path, resolved against the launcher's directory
    script = ("import numpy as np, hvdlite as hvd\n"
              "hvd.init()\n"
              "hvd.allreduce(np.ones(3), name='launched')\n")
    result = run_cli(["run", "-np", "2", "--timeline-filename", "tl.json",
                      "--timeline-mark-cycles", sys.executable, "-c", script], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    events = json.loads((tmp_path / "tl.json").read_text())
    rows = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert "launched" in rows, rows
    assert any(e.get("name") == "CYCLE_START" for e in events)


def test_failing_rank_gives_nonzero_exit():
    code = "import os, sys; sys.exit(3 if os.environ.get('PMI_RANK') == '1' else 0)"
    result = run_cli(["run", "-np", "2", sys.executable, "-c", code])
    assert result.returncode != 0, _output(result)


@pytest.mark.parametrize("np_", [2, 3])
def test_output_filename_tees_each_rank(tmp_path, np_):
    """horovodrun's --output-filename: DIR/rank.N/stdout and stderr, and the console as usual."""
    script = ("import sys, numpy as np, hvdlite as hvd\n"
              "hvd.init()\n"
              "total = hvd.allreduce(np.array([hvd.rank()]), op=hvd.Sum, name='sum')\n"
              "print(f'out {hvd.rank()} {int(total[0])}', flush=True)\n"
              "print(f'err {hvd.rank()}', file=sys.stderr, flush=True)\n")
    result = run_cli(["run", "-np", str(np_), "--output-filename", "logs", sys.executable,
                      "-c", script], cwd=tmp_path)
    assert result.returncode == 0, _output(result)
    total = sum(range(np_))
    assert sorted(path.name for path in (tmp_path / "logs").iterdir()) == [
        f"rank.{r}" for r in range(np_)]
    for r in range(np_):
        assert (tmp_path / "logs" / f"rank.{r}" / "stdout").read_text() == f"out {r} {total}\n"
        assert (tmp_path / "logs" / f"rank.{r}" / "stderr").read_text() == f"err {r}\n"
        assert f"out {r} {total}" in result.stdout and f"err {r}" in result.stderr


def test_network_interface_reaches_the_launcher_and_nccl():
    script = ("import os, numpy as np, hvdlite as hvd\n"
              "hvd.init()\n"
              "total = hvd.allreduce(np.array([1]), op=hvd.Sum, name='nic')\n"
              "nic = os.environ['NCCL_SOCKET_IFNAME']\n"   # one write: lines stay whole
              "os.write(1, f'NIC {hvd.rank()} {int(total[0])} {nic}\\n'.encode())\n")
    result = run_cli(["run", "-np", "2", "--network-interface", "lo", "--verbose",
                      sys.executable, "-c", script])
    assert result.returncode == 0, _output(result)
    assert " -iface lo " in result.stderr, _output(result)   # MPICH's spelling
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("NIC")) == [
        "NIC 0 2 lo", "NIC 1 2 lo"]


def test_output_filename_keeps_a_failing_rank_s_exit_and_traceback(tmp_path):
    code = ("import os, sys\n"
            "if os.environ.get('PMI_RANK') == '1':\n"
            "    raise SystemExit('rank one gives up')\n")
    result = run_cli(["run", "-np", "2", "--output-filename", str(tmp_path / "logs"),
                      sys.executable, "-c", code])
    assert result.returncode != 0, _output(result)
    assert "rank one gives up" in (tmp_path / "logs" / "rank.1" / "stderr").read_text()
    assert (tmp_path / "logs" / "rank.0" / "stderr").read_text() == ""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGINT", "SIGKILL"])
@pytest.mark.parametrize("output", [False, True], ids=["console", "output-filename"])
def test_signal_stops_the_whole_job(tmp_path, sig, output):
    """SIGTERM, or Ctrl-C (SIGINT), to hvdlite stops every rank (also the ranks that run under
    --output-filename's per-rank wrapper); the exit status is 128+sig.  SIGKILL, which hvdlite
    cannot forward, stops them too: the MPI launcher gets SIGTERM when hvdlite dies."""
    code = ("import os, signal, sys, time\n"
            "def stop(signum, frame):\n"   # a rank told to stop (not killed) says so
            "    open(os.path.join(sys.argv[1], f'{os.getpid()}.stopped'), 'w').close()\n"
            "    sys.exit(1)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "signal.signal(signal.SIGINT, stop)\n"
            "open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\n"
            "time.sleep(120)\n")
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    extra = ["--output-filename", str(tmp_path / "logs")] if output else []
    proc = subprocess.Popen([sys.executable, "-m", "hvdlite.runner", "run", "-np", "2", *extra,
                             sys.executable, "-c", code, str(pids_dir)], cwd=REPO,
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(pids_dir.iterdir())) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        pids = [int(path.name) for path in pids_dir.iterdir() if path.name.isdigit()]
        assert len(pids) == 2, "the ranks did not start"
        os.kill(proc.pid, sig)
        proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig)
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.05)
    for pid in alive:   # leave no orphan behind a failing test
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"ranks {alive} survived hvdlite's {sig.name}"
    stopped = sorted(int(path.stem) for path in pids_dir.glob("*.stopped"))
    assert stopped == sorted(pids), f"ranks {pids} were killed, not stopped: {stopped}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    try:
        return status.read_text().split(")")[-1].split()[0] != "Z"  # zombies are dead
    except OSError:
        return False


@pytest.mark.parametrize("argv", [["--check-build"], ["run", "--check-build"]])
def test_check_build_output(argv):
    import importlib.util

    import hvdlite
    result = run_cli(argv)
    assert result.returncode == 0, _output(result)
    out = result.stdout
    assert out.startswith(f"hvdlite v{hvdlite.__version__}:")
    torch = importlib.util.find_spec("torch") is not None
    assert (("[X] PyTorch" if torch else "[ ] PyTorch") in out), out
    controllers = out.split("Available Controllers:")[1].split("\n\n")[0]
    assert "[X] MPI" in controllers  # this very job runs on mpi4py
    assert ("[X] Gloo" in controllers) == bool(hvdlite.gloo_built())
    ops = out.split("Available Tensor Operations:")[1].split("\n\n")[0]
    assert "[X] MPI" in ops
    for name, query in (("NCCL", hvdlite.nccl_built), ("DDL", hvdlite.ddl_built),
                        ("CCL", hvdlite.ccl_built), ("Gloo", hvdlite.gloo_built)):
        assert (f"[X] {name}" in ops) == bool(query()), out
    assert "MPI library: MPICH Version:" in out
    assert f"MPI launcher: {VENV_BIN}/mpiexec (MPICH" in out
    assert "WARNING" not in out
