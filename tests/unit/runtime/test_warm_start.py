"""Warm starts (hvdlite.common.runtime.warm_start, hvdlite.runner.elastic.warm_process) with
real processes: the elastic driver's listener, the shield that the MPI launcher would start,
the host's warm process and the workers it forks.  The whole elastic job with warm starts is
tested in tests/elastic and tests/multihost/test_elastic.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdlite.common.runtime import elastic_wire, warm_start
from hvdlite.runner.elastic import warm_process
from hvdlite.runner.elastic.server import Server

REPO = Path(__file__).resolve().parents[3]


def test_the_names_agree_with_the_wire():
    assert warm_start.DRIVER_VARIABLE == elastic_wire.DRIVER_VARIABLE
    assert warm_start.KEY_VARIABLE == elastic_wire.KEY_VARIABLE
    # the workers below and tests/elastic/workers/elastic_worker.py read it by name
    assert warm_start.CHILD_VARIABLE == "HVDLITE_ELASTIC_WARM_CHILD"


def test_after_the_first_commit_s_report_commits_cost_nothing(monkeypatch):
    """``report_modules`` runs at every commit: only ``hvd.init()`` and the first commit look
    at the modules (a look is ~0.1 s of ``realpath`` calls)."""
    looked = []
    monkeypatch.setattr(warm_start, "library_modules", lambda skip: looked.append(1) or ["json"])
    monkeypatch.setattr(warm_start, "_reported", set())
    monkeypatch.setattr(warm_start, "_finished", False)
    monkeypatch.setenv(warm_start.WARM_VARIABLE, os.urandom(6).hex())   # nobody listens
    monkeypatch.delenv(warm_start.CHILD_VARIABLE, raising=False)
    warm_start.report_modules()             # hvd.init()
    warm_start.report_modules(last=True)    # the first commit
    for _ in range(5):                      # every later commit
        warm_start.report_modules(last=True)
    assert len(looked) == 2


@pytest.mark.parametrize("argv, takes", [
    ([sys.executable, "train.py", "--lr", "1"], True),
    ([sys.executable, "-m", "pkg.train"], True),
    ([sys.executable, "-u", "train.py"], True),
    ([os.path.basename(sys.executable), "train.py"], None),   # found on PATH: same as this one
    ([sys.executable, "-c", "print(1)"], False),               # not a script or module
    ([sys.executable, "-O", "train.py"], False),               # interpreter options differ
    ([sys.executable, "-m"], False),
    ([sys.executable], False),
    (["/bin/sh", "train.sh"], False),                          # another program
])
def test_only_this_interpreter_running_a_script_or_module_is_taken(argv, takes):
    if takes is None:   # depends on what PATH finds first
        import shutil
        found = shutil.which(argv[0])
        takes = bool(found) and os.path.abspath(found) == os.path.abspath(sys.executable)
    assert warm_process.python_command(argv) is takes


def test_library_modules_leave_out_the_script_hvdlite_and_mpi(tmp_path, monkeypatch):
    import json  # noqa: F401 - a standard library module: preloaded
    (tmp_path / "my_model_code.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_model_code  # noqa: F401 - the script's own module: never preloaded
    names = warm_start.library_modules()
    assert "json" in names and "numpy" in names
    assert "my_model_code" not in names
    assert not [n for n in names if n.startswith(("hvdlite", "__main__", "mpi4py.MPI"))]


def test_a_socket_path_that_would_be_too_long_is_refused(monkeypatch, tmp_path):
    assert warm_start.socket_path("abc").endswith("hvdlite-warm-abc.sock")
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert warm_start.socket_path("abc") is None


# --- a warm process behind a real driver listener ----------------------------------------------
WORKER = """
import os, signal, sys
print("argv", sys.argv[1:])
print("main", __name__, os.path.basename(__file__))
print("parent-is-shield", os.environ["HVDLITE_ELASTIC_SHIELD"] == str(os.getppid()))
print("own-session", os.getsid(0) == os.getpid())
print("warm", os.environ.get("HVDLITE_ELASTIC_WARM_CHILD") == "1")
print("preloaded", "decimal" in sys.modules)
print("hvdlite-preloaded", "hvdlite" in sys.modules)
print("mark", os.environ.get("WARM_TEST_MARK"))
print("cwd", os.getcwd())
print("stdin", sys.stdin.read().strip())
sys.stdout.flush()
if sys.argv[1] == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
raise SystemExit(int(sys.argv[1]))
"""


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A driver's listener and the environment its workers get."""
    server = Server("127.0.0.1")
    token = os.urandom(6).hex()
    env = {**os.environ, elastic_wire.DRIVER_VARIABLE: f"127.0.0.1:{server.port}",
           elastic_wire.KEY_VARIABLE: server.key.hex(), warm_start.WARM_VARIABLE: token,
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(warm_start.CHILD_VARIABLE, None)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    yield server, env, script, warm_start.socket_path(token)
    server.close()


def shield(env, script, *args, stdin="hello", cwd=None, mark="one"):
    return subprocess.run([sys.executable, "-m", "hvdlite.runner.elastic.shield", "--",
                           sys.executable, str(script), *args], input=stdin,
                          capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**env, "WARM_TEST_MARK": mark})


def lines(done) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)


def wait_for(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def warm_processes(token_path: str) -> list[int]:
    token = Path(token_path).name[len("hvdlite-warm-"):-len(".sock")]
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if token.encode() in cmdline and any(b"warm_process.py" in part for part in cmdline):
            found.append(int(pid))
    return found


def test_the_first_worker_starts_cold_and_later_ones_are_forked_warm(job, tmp_path):
    server, env, script, path = job
    first = shield(env, script, "3")
    assert first.returncode == 3, first.stderr
    cold = lines(first)
    assert cold["warm"] == "False" and cold["parent-is-shield"] == "True", first.stdout
    wait_for(lambda: os.path.exists(path))   # the first shield started the warm process
    assert os.stat(path).st_mode & 0o077 == 0   # its owner alone may connect

    # until a worker has said what it imported, the warm process has nothing to offer: cold
    early = shield(env, script, "0")
    assert lines(early)["warm"] == "False" and "cold" not in early.stderr, early.stderr

    # what a worker sends at hvd.init() and its first commit: the warm process imports it
    with warm_start.connect(path) as sock:
        warm_start.send_message(sock, {"op": "preload", "modules": ["decimal", "hvdlite.common",
                                                             "no_such_module_here"]})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    second = shield(env, script, "5", "--flag", stdin="from stdin", cwd=elsewhere, mark="two")
    assert second.returncode == 5, second.stderr
    warm = lines(second)
    assert warm["warm"] == "True" and warm["parent-is-shield"] == "False", second.stdout
    assert warm["own-session"] == "True" and warm["main"] == "__main__ worker.py"
    assert warm["argv"] == "['5', '--flag']" and warm["stdin"] == "from stdin"
    # the environment and directory are this shield's, not the first one's
    assert warm["mark"] == "two" and warm["cwd"] == str(elsewhere)
    assert warm["preloaded"] == "True" and warm["hvdlite-preloaded"] == "False"

    # a worker killed by a signal: the shield ends the same way (what the launcher sees)
    killed = shield(env, script, "signal")
    assert killed.returncode == -signal.SIGTERM and lines(killed)["warm"] == "True"

    # the job ends: the warm process goes with the driver and takes its socket with it
    pids = warm_processes(path)
    assert len(pids) == 1, pids
    server.close()
    wait_for(lambda: not warm_processes(path), 10)
    assert not os.path.exists(path) and not os.path.exists(path + ".lock")


def test_a_command_it_cannot_take_starts_cold(job):
    server, env, script, path = job
    first = shield(env, script, "0")
    wait_for(lambda: os.path.exists(path))
    done = subprocess.run([sys.executable, "-m", "hvdlite.runner.elastic.shield", "--",
                           sys.executable, "-c", "import os; print(os.environ.get("
                           "'HVDLITE_ELASTIC_WARM_CHILD'))"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert first.returncode == 0 and done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_no_warm_process_without_the_driver_s_token(job):
    server, env, script, path = job
    env = {k: v for k, v in env.items() if k != warm_start.WARM_VARIABLE}
    for _ in range(2):
        done = shield(env, script, "0")
        assert done.returncode == 0 and lines(done)["warm"] == "False", done.stderr
    assert not os.path.exists(path) and not warm_processes(path)
