"""An elastic worker's output outlives its launcher's pipes (issue 54): a child process with
the relay installed writes through a pipe this test holds; the test closes its end (the
launcher's proxy is gone); the child's later writes do not raise, reach the fallback, and the
child exits 0."""
import os
import subprocess
import sys

from tests.mpi_harness import REPO

CHILD = r"""
import os, sys, threading
from hvdlite.common.runtime import output_relay
out = {fd: open(f"{sys.argv[1]}.{fd}", "ab", buffering=0) for fd in (1, 2)}
output_relay.install(lambda fd, data: out[fd].write(data))
print("first", flush=True)
sys.stdin.readline()                    # the test has closed the pipe
print("second", flush=True)             # would raise BrokenPipeError without the relay
threading.Thread(target=lambda: print("from a thread", file=sys.stderr, flush=True)).start()
os.write(1, b"raw write\n")
print("at exit")                         # flushed at exit, after the relay's drain
"""


def test_writes_after_the_launchers_pipe_is_gone_reach_the_fallback(tmp_path):
    fallback = tmp_path / "fallback"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(fallback)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == b"first\n"
    proc.stdout.close()
    proc.stderr.close()
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    stdout, stderr = (tmp_path / "fallback.1").read_bytes(), (tmp_path / "fallback.2").read_bytes()
    assert stdout == b"second\nraw write\nat exit\n", stdout
    assert stderr == b"from a thread\n", stderr
