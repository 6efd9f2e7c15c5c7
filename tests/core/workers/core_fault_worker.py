"""Faulty jobs: a rank that dies or stalls while the others wait on it.

argv[1] is the scenario, argv[2] (optional, default: the last rank; -1 works too) the rank
that misbehaves:
  raise         the last rank raises an exception while the others wait on an allreduce
  exit          the last rank's script simply ends while the others wait on an allreduce
  hard_exit     the last rank leaves with os._exit(3) (no hvdlite shutdown at all)
  vanished      the last rank's process looks gone to the others (their record of it points at
                an exited process) while the launcher keeps everything running
  stall_warn    the last rank submits 3 s late (run with HVDLITE_STALL_CHECK_TIME_SECONDS=1)
  stall_shutdown  the last rank never submits one tensor (stall check 1 s, shutdown 2 s)
  stall_late    the last rank submits one tensor only after the others gave up on it (same
                settings): its own StallError says that the others gave up, not that they
                skipped it
  stall_mismatch  the last rank submits a tensor under another name than the others (same
                settings): every rank's StallError says what the missing ranks wait on instead
  data_stall_warn      the last rank's background thread stops for 3 s inside the data
                       exchange of an agreed 2 MiB allreduce (the shared window's first
                       barrier; stall check 1 s): the others warn, then all finish correctly
  data_stall_shutdown  the same for 6 s with the stall shutdown at 2 s: every rank raises
                       StallError from the data exchange instead of waiting for ever
  vanished_before_set_change  the last rank is gone as in "vanished" while the others add,
                       then remove, a process set (run with HVDLITE_DYNAMIC_PROCESS_SETS=1):
                       both raise RankExitedError within seconds

Survivors report their cases and then re-raise what they caught, so that mpiexec exits non-zero
whichever rank it hears from first.  Every rank prints a marker line to stderr too, so the pytest
side can assert on the text even if a rank is killed before its JSON is written.
"""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import hvdlite as hvd
from tests.workers.core_refs import attempt, check_exact
from tests.workers._report import Reporter

SCENARIO = sys.argv[1]
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
ODD = int(sys.argv[2]) % SIZE if len(sys.argv) > 2 else SIZE - 1   # the faulty rank
world = MPI.COMM_WORLD
r = Reporter(RANK)


def say(msg):
    print(f"[fault-worker rank {RANK}] {msg}", file=sys.stderr, flush=True)


def wait_for(sources, tag):
    """Receive one message with ``tag`` from each of ``sources`` without spinning."""
    for source in sources:
        while not world.iprobe(source=source, tag=tag):
            time.sleep(0.01)
        world.recv(source=source, tag=tag)


def warm_up():
    got = hvd.allreduce(np.full(3, RANK + 1.0), op=hvd.Sum, name="warmup")
    check_exact("warmup", got, np.full(3, float(sum(range(1, SIZE + 1)))))


r.case("warmup", warm_up)


def stop_as_if_gone(delay: float) -> None:
    """The odd rank of the "vanished" scenarios: report, wait ``delay`` s, then stop (SIGSTOP:
    its background thread no longer answers, yet the launcher sees a live process); the
    survivors' non-zero exit ends the job."""
    import signal
    r.write()
    time.sleep(delay)
    say("stopping as if gone")
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)


def exited_identity() -> tuple[int, int]:
    """(pid, start time) of a process that has exited: pointing a survivor's record of the odd
    rank at it makes that rank look gone to hvdlite's node-local check."""
    import subprocess
    from hvdlite.common.runtime import liveness
    assert ODD in liveness._peers, f"rank {ODD} was not recorded at init: {liveness._peers}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = (child.pid, liveness._start_time(child.pid))
    assert identity[1] is not None and liveness.vanished([]) == []
    child.kill()
    child.wait()
    return identity


def survivor_waits():
    """Wait on an allreduce the last rank never joins; must fail fast with RankExitedError."""
    start = time.monotonic()
    pending = [hvd.allreduce_async(np.ones(3), name="pending.a"),
               hvd.allgather_async(np.ones((2, 2)), name="pending.b"),
               hvd.broadcast_async_(np.ones(5), 0, name="pending.c")]
    caught = attempt(lambda: hvd.allreduce(np.ones(4), name="wait_on_exited_rank"))
    elapsed = time.monotonic() - start
    say(f"caught {type(caught).__name__} after {elapsed:.2f} s: {caught}")
    others = [attempt(lambda h=h: h.wait(timeout=10)) for h in pending]

    def check():
        assert isinstance(caught, hvd.RankExitedError), f"got {caught!r}"
        assert isinstance(caught, hvd.ShutdownError) and isinstance(caught, hvd.HvdliteError)
        assert str(ODD) in str(caught), f"message does not name rank {ODD}: {caught}"
        assert elapsed < 10.0, f"took {elapsed:.1f} s to notice"
        for h, exc in zip(pending, others):
            assert isinstance(exc, hvd.RankExitedError), f"{h.name}: got {exc!r}"
            assert h.name in str(exc), f"error does not name the tensor: {exc}"

    def later_ops_fail():
        try:
            hvd.allreduce(np.ones(2), name="after_exit")
        except hvd.HvdliteError as exc:
            say(f"later op raised {type(exc).__name__}")
        else:
            raise AssertionError("an op after the peer exited succeeded")

    r.case("wait_on_exited_rank", check)
    r.case("later_ops_fail", later_ops_fail)
    r.write()
    if caught is not None:
        raise caught


if SCENARIO in ("raise", "exit", "hard_exit"):
    if RANK == ODD:
        time.sleep(0.5)   # let the others start waiting first
        r.write()
        if SCENARIO == "raise":
            say("raising now")
            raise RuntimeError(f"deliberate failure on rank {RANK}")
        if SCENARIO == "hard_exit":
            say("os._exit now")
            os._exit(3)
        say("ending normally now")
        sys.exit(0)
    survivor_waits()

elif SCENARIO == "stall_warn":
    def late_submit():
        if RANK == ODD:
            time.sleep(3.0)
        xs = [np.arange(5, dtype=np.int32) * (k + 1) for k in range(SIZE)]
        got = hvd.allreduce(xs[RANK], op=hvd.Sum, name="late")
        check_exact("late", got, sum(xs).astype(np.int32))

    r.case("late_result_correct", late_submit)
    r.case("after", warm_up)
    r.write()
    hvd.shutdown()

elif SCENARIO == "stall_shutdown":
    def stalled():
        done_tag = 77
        if RANK != ODD:
            start = time.monotonic()
            caught = attempt(lambda: hvd.allreduce_async(np.ones(3), name="stalled").wait())
            elapsed = time.monotonic() - start
            say(f"caught {type(caught).__name__} after {elapsed:.2f} s: {caught}")
            world.send(True, dest=ODD, tag=done_tag)
            assert isinstance(caught, hvd.StallError), f"got {caught!r}"
            assert isinstance(caught, hvd.HvdliteError)
            assert "stalled" in str(caught), str(caught)
            assert str([ODD]) in str(caught), f"missing ranks not named: {caught}"
            assert f"rank {ODD} has no operation pending" in str(caught), str(caught)
            assert 1.5 <= elapsed < 15.0, f"StallError after {elapsed:.1f} s"
        else:
            # never submit 'stalled'; wait (without spinning) until the others gave up on it
            wait_for([k for k in range(SIZE) if k != ODD], done_tag)

    def after_stall():
        xs = [np.arange(4, dtype=np.float64) + k for k in range(SIZE)]
        got = hvd.allreduce(xs[RANK], op=hvd.Sum, name="after_stall")
        check_exact("after_stall", got, sum(xs))
        got = hvd.allreduce(xs[RANK], op=hvd.Max, name="stalled")   # the name is free again
        check_exact("stalled name reused", got, xs[SIZE - 1])

    r.case("stalled_tensor_errors", stalled)
    r.case("job_keeps_working", after_stall)
    r.write()
    hvd.shutdown()

elif SCENARIO == "stall_late":
    def late_tensor():
        hvd.allreduce(np.ones(3), name="late_tensor")

    def submitted_too_late():
        gave_up_tag, late_done_tag = 78, 79
        others = [k for k in range(SIZE) if k != ODD]
        if RANK != ODD:
            caught = attempt(late_tensor)
            say(f"caught {type(caught).__name__} (on time): {caught}")
            world.send(True, dest=ODD, tag=gave_up_tag)
            wait_for([ODD], late_done_tag)   # stay in the job until the late rank has its error
            assert isinstance(caught, hvd.StallError), f"got {caught!r}"
            assert "rank-dependent control flow" in str(caught), str(caught)
        else:
            wait_for(others, gave_up_tag)
            start = time.monotonic()
            caught = attempt(late_tensor)
            elapsed = time.monotonic() - start
            say(f"caught {type(caught).__name__} (late) after {elapsed:.2f} s: {caught}")
            for k in others:
                world.send(True, dest=k, tag=late_done_tag)
            assert isinstance(caught, hvd.StallError), f"got {caught!r}"
            text = str(caught)
            assert f"submitted on ranks {[ODD]} but missing on ranks {others}" in text, text
            assert f"Ranks {others} already gave up on this tensor" in text, text
            assert "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS well above" in text, text
            assert "rank-dependent control flow" not in text, text

    r.case("late_submission_explained", submitted_too_late)
    r.case("job_keeps_working", warm_up)
    r.write()
    hvd.shutdown()

elif SCENARIO == "stall_mismatch":
    def diverged():
        """The others submit 'step.even' first; the odd rank submits 'step.odd' once they have,
        so 'step.even' stalls first, while the odd rank waits on 'step.odd'.  The others then
        submit nothing until the odd rank has its own error."""
        submitted_tag, done_tag = 80, 81
        others = [k for k in range(SIZE) if k != ODD]
        if RANK != ODD:
            handle = hvd.allreduce_async(np.ones(3), name="step.even")
            world.send(True, dest=ODD, tag=submitted_tag)
            caught = attempt(handle.wait)
            say(f"caught {type(caught).__name__}: {caught}")
            wait_for([ODD], done_tag)
            assert isinstance(caught, hvd.StallError), f"got {caught!r}"
            assert f"rank {ODD} is waiting on 'step.odd'" in str(caught), str(caught)
        else:
            wait_for(others, submitted_tag)
            caught = attempt(lambda: hvd.allreduce(np.ones(3), name="step.odd"))
            say(f"caught {type(caught).__name__}: {caught}")
            for k in others:
                world.send(True, dest=k, tag=done_tag)
            assert isinstance(caught, hvd.StallError), f"got {caught!r}"
            for k in others:   # they still wait on theirs, or already failed it (a later report)
                assert (f"rank {k} is waiting on 'step.even'" in str(caught)
                        or f"rank {k} has no operation pending" in str(caught)), str(caught)

    r.case("missing_ranks_named_with_their_tensors", diverged)
    r.case("job_keeps_working", warm_up)
    r.write()
    hvd.shutdown()

elif SCENARIO in ("data_stall_warn", "data_stall_shutdown"):
    from hvdlite.common.intranode.direct_copies import DirectCopies
    from hvdlite.common.intranode.shared_window import SharedWindow
    # The background thread stops once, after negotiation agreed, at the first wait of the
    # data path: direct copies between the ranks (the first allgather), or with HVDLITE_DIRECT_COPIES=0
    # the shared window (the first barrier).
    stopped = []
    for cls, method in ((DirectCopies, "_wait"), (SharedWindow, "_barrier")):
        def stopping(self, *args, _real=getattr(cls, method)):
            if RANK == ODD and not stopped:
                stopped.append(type(self).__name__)
                time.sleep(3.0 if SCENARIO == "data_stall_warn" else 6.0)
            return _real(self, *args)
        setattr(cls, method, stopping)
    xs = [np.arange(1 << 19, dtype=np.float32) + k for k in range(SIZE)]   # 2 MiB, one tensor
    PATH = "SharedWindow" if os.environ.get("HVDLITE_DIRECT_COPIES") == "0" else "DirectCopies"

    def slow_data():
        got = hvd.allreduce(xs[RANK], op=hvd.Sum, name="slow_data")
        check_exact("slow_data", got, sum(xs))
        assert stopped == ([PATH] if RANK == ODD else []), (stopped, PATH)

    def stalled_data():
        start = time.monotonic()
        caught = attempt(lambda: hvd.allreduce(xs[RANK], op=hvd.Sum, name="slow_data"))
        say(f"caught {type(caught).__name__} after {time.monotonic() - start:.2f} s: {caught}")
        if RANK == ODD and type(caught).__name__ == "DirectCopyError":
            # The stopped rank, late, found its peers' memory gone (they gave up and ended).
            assert "could not be reached" in str(caught), str(caught)
            return
        assert isinstance(caught, hvd.StallError), f"got {caught!r}"
        assert "data exchange" in str(caught), str(caught)

    if SCENARIO == "data_stall_warn":
        r.case("slow_data_correct", slow_data)
        r.case("after", warm_up)
    else:
        r.case("stalled_data_errors", stalled_data)
    r.write()
    hvd.shutdown()
elif SCENARIO in ("vanished", "vanished_late_waiter"):
    # The odd rank's process is "gone" without the launcher noticing (as under srun without
    # --kill-on-bad-exit): it stops itself (SIGSTOP: its background thread no longer answers,
    # yet the launcher sees a live process), and the survivors' record of it is pointed at a
    # process that has exited.  hvdlite itself must turn their wait into RankExitedError.
    # "vanished_late_waiter": the lowest surviving rank starts waiting 1.2 s after the others,
    # so it notices only after they have noticed, exited and begun aborting the job.
    if RANK == ODD:
        stop_as_if_gone(0.5)   # after letting the others start waiting
    from hvdlite.common.runtime import liveness
    liveness._peers[ODD] = exited_identity()
    if SCENARIO == "vanished_late_waiter" and RANK == min(k for k in range(SIZE) if k != ODD):
        time.sleep(1.2)
    survivor_waits()
elif SCENARIO == "vanished_before_set_change":
    # add_process_set / remove_process_set are collectives over the whole world outside the
    # engine.  The odd rank is "gone" as in the vanished scenario (stopped, the launcher keeps
    # the job running), but the survivors learn it only 1.5 s after they entered
    # add_process_set: their wait inside it must notice and raise RankExitedError; the
    # removal after it must raise at once.
    if RANK == ODD:
        stop_as_if_gone(0.0)
    import threading
    from hvdlite.common.runtime import liveness
    threading.Timer(1.5, liveness._peers.__setitem__, (ODD, exited_identity())).start()
    start = time.monotonic()
    caught = attempt(lambda: hvd.add_process_set([k for k in range(SIZE) if k != ODD]))
    elapsed = time.monotonic() - start
    say(f"caught {type(caught).__name__} after {elapsed:.2f} s: {caught}")
    removal = attempt(lambda: hvd.remove_process_set(hvd.ProcessSet([0])))

    def add_fails():
        assert isinstance(caught, hvd.RankExitedError), f"got {caught!r}"
        assert f"[{ODD}]" in str(caught), f"message does not name rank {ODD}: {caught}"
        assert "the exchange that registers a process set" in str(caught), str(caught)
        assert 1.4 < elapsed < 10.0, f"took {elapsed:.1f} s"

    def remove_fails():
        assert isinstance(removal, hvd.RankExitedError), f"got {removal!r}"
        assert "the exchange of hvd.remove_process_set()" in str(removal), str(removal)

    r.case("add_set_after_exit", add_fails)
    r.case("remove_set_after_exit", remove_fails)
    r.write()
    if caught is not None:
        raise caught
else:
    raise SystemExit(f"unknown scenario {SCENARIO!r}")
