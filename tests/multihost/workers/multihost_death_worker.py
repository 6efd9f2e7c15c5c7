"""A rank ends without ``hvd.shutdown()`` while the ranks on the other hosts wait on it: they
must raise RankExitedError naming the rank and its host within seconds, and the job must end
non-zero with nothing left running (tests/multihost/test_death.py).

argv: how the victim ends, the victim's rank.
  exit_code   os._exit(1) (no atexit: MPI and hvdlite are told nothing)
  exit_zero   os._exit(0) (a clean exit code, but still no shutdown)
  signal      SIGKILL to itself
  exception   an uncaught exception (the interpreter exits, atexit shuts hvdlite down)
  host        its whole host goes: every process in the host's PID namespace is killed
"""
import json
import os
import signal
import socket
import sys
import time

import numpy as np

import hvdlite as hvd
from tests.workers._report import Reporter

HOW, VICTIM = sys.argv[1], int(sys.argv[2])
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
HOST = socket.gethostname()
r = Reporter(RANK)
hosts = hvd.allgather_object(HOST)
VICTIM_HOST = hosts[VICTIM]
hvd.allreduce(np.ones(3), name="warmup")


def say(msg: str) -> None:
    print(f"[death-worker rank {RANK} on {HOST}] {msg}", file=sys.stderr, flush=True)


if RANK == VICTIM:
    time.sleep(1.0)   # the others are waiting by now
    r.write()
    say(f"ending by {HOW}")
    if HOW == "exit_code":
        os._exit(1)
    if HOW == "exit_zero":
        os._exit(0)
    if HOW == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    if HOW == "exception":
        raise RuntimeError(f"deliberate failure on rank {RANK}")
    if HOW == "host":
        os.kill(-1, signal.SIGKILL)   # every process of this PID namespace: the whole host
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(f"unknown way to end: {HOW}")

start = time.monotonic()
try:
    hvd.allreduce(np.ones(4), name="waits_on_the_victim")
    caught = None
except Exception as exc:   # noqa: BLE001 - checked below
    caught = exc
elapsed = time.monotonic() - start
say(f"caught {type(caught).__name__} after {elapsed:.2f} s: {caught}")
later = None
try:
    hvd.allreduce(np.ones(2), name="after")
except Exception as exc:   # noqa: BLE001
    later = exc


ON_VICTIM_HOST = [k for k in range(SIZE) if hosts[k] == VICTIM_HOST]


def check():
    assert isinstance(caught, hvd.RankExitedError), f"got {caught!r}"
    text = str(caught).lower()
    # the victim, or a rank of its host that went with it (the launcher kills a failed rank's
    # siblings on its host; a host that goes takes them all)
    named = [k for k in ON_VICTIM_HOST if f"rank {k} " in text or f"rank(s) [{k}]" in text]
    assert named, f"no rank of host {VICTIM_HOST} ({ON_VICTIM_HOST}) is named: {caught}"
    if HOW != "exception":   # a shutdown by the victim is announced in the negotiation instead
        assert VICTIM_HOST in text, f"the host {VICTIM_HOST} is not named: {caught}"
    assert elapsed < 10.0, f"took {elapsed:.1f} s"
    assert isinstance(later, hvd.RankExitedError), f"a later op: {later!r}"


r.case("victim_reported", check)
r.results["elapsed"] = json.dumps(round(elapsed, 3))
r.write()
raise caught if caught is not None else SystemExit("no error raised")
