"""Running an MPI launcher as a supervised child: its own process group, stopped with this
process, signals forwarded, output copied, exit status as a shell reports it.  Used by
``hvdlite run`` (:mod:`.launch`) and the elastic driver (:mod:`.elastic.driver`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Callable, Mapping, Sequence, TextIO

from .launch_errors import LaunchError

# After forwarding Ctrl-C/SIGTERM, wait this long for the job to exit before SIGKILL.
KILL_GRACE_SECONDS = 5.0


def exit_status(returncode: int | None) -> int:
    """A shell's exit status for a child's ``returncode``: 128 + N for a death by signal N,
    1 for a child that has not ended."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def kill_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads, if it still exists."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _install_handlers(handler: Callable[[int, object], None]) -> dict:
    """Install ``handler`` for SIGINT and SIGTERM (main thread only); returns the old ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _pump(source: BinaryIO, sink: TextIO) -> None:
    """Copy the job's output to ``sink`` as it arrives (a notebook's sys.stdout is not fd 1)."""
    for chunk in iter(lambda: source.read1(1 << 16), b""):
        sink.write(chunk.decode(errors="replace"))
        sink.flush()


def _stop_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has Linux send the MPI launcher SIGTERM when the thread that
    started it dies, even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``): the launcher then stops
    every rank instead of leaving the job running without anyone to wait for it.  None where
    that is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigterm, parent = 1, int(signal.SIGTERM), os.getpid()

    def preexec() -> None:   # in the child, between fork and exec: no imports, no allocation
        prctl(pr_set_pdeathsig, sigterm)
        if os.getppid() != parent:   # this process died before the request took effect
            os.kill(os.getpid(), sigterm)
    return preexec


def start_job(argv: Sequence[str], env: Mapping[str, str],
              output: tuple[TextIO, TextIO] | None = None
              ) -> tuple[subprocess.Popen, list[threading.Thread]]:
    """Start the launcher in its own process group (stopped by Linux if this process dies,
    see :func:`_stop_with_this_process`); with ``output`` (stdout, stderr text streams) the
    job's output is copied there by the returned threads."""
    pipe = subprocess.PIPE if output is not None else None
    try:
        proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True,
                                stdout=pipe, stderr=pipe,
                                preexec_fn=_stop_with_this_process())
    except OSError as exc:
        raise LaunchError(f"cannot start {argv[0]}: {exc.strerror}") from None
    pumps = [threading.Thread(target=_pump, args=(source, sink), daemon=True)
             for source, sink in zip((proc.stdout, proc.stderr), output or ())]
    for pump in pumps:
        pump.start()
    return proc, pumps


def run_job(argv: Sequence[str], env: Mapping[str, str],
            output: tuple[TextIO, TextIO] | None = None) -> int:
    """Run the launcher in its own process group and return the job's exit status.

    SIGINT/SIGTERM received here are forwarded to the group (the MPI launcher then stops every
    rank); if the job is still running :data:`KILL_GRACE_SECONDS` later, or a second signal
    arrives, the group is killed.  A job ended by a signal returns 128 + the signal number.
    If this process dies without a chance to forward anything (SIGKILL, a crash), Linux sends
    the MPI launcher SIGTERM (see :func:`_stop_with_this_process`).  With ``output`` (stdout,
    stderr text streams) the job's output is copied there instead of going to this process's
    file descriptors.
    """
    proc, pumps = start_job(argv, env, output)
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        kill_group(proc.pid, signum if len(received) == 1 else signal.SIGKILL)

    previous = _install_handlers(forward)
    try:
        deadline = None
        while proc.poll() is None:
            if received and deadline is None:
                deadline = time.monotonic() + KILL_GRACE_SECONDS
            elif deadline is not None and time.monotonic() > deadline:
                kill_group(proc.pid, signal.SIGKILL)
                deadline = float("inf")
            try:
                proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for pump in pumps:   # the ranks may still hold the pipes a moment; never wait for ever
            pump.join(KILL_GRACE_SECONDS)
    return 128 + received[0] if received else exit_status(proc.returncode)
