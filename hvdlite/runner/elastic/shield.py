"""``python -m hvdlite.runner.elastic.shield -- COMMAND...``: how the elastic driver starts each
worker, so that the MPI launcher's clean-up cannot kill it before it has reported.

When one process of a world dies, MPICH's launcher kills the others at once (every rank of the
job when the process died of a signal or its host was lost, the other ranks of its host when it
exited with an error), before they can hand their newest commit to the driver.  So each rank
runs COMMAND in a process of its own, in a session of its own, and this process, which the
launcher started and will kill, only waits for it and passes its exit status (and the
launcher's SIGTERM/SIGINT/SIGHUP) on.  The worker learns that it lost this process through
:data:`SHIELD_VARIABLE` and then ends itself once it has reported, or when the driver is gone,
or after a grace period (see ``hvdlite.common.runtime.elastic_channel``).
"""
from __future__ import annotations

import os
import signal
import sys

# Set to the shield's pid in the worker (elastic_wire.SHIELD_VARIABLE: this module stays free of
# imports, for it starts before every worker; a test checks that the names agree).
SHIELD_VARIABLE = "HVDLITE_ELASTIC_SHIELD"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m hvdlite.runner.elastic.shield -- COMMAND ...", file=sys.stderr)
        return 2
    os.environ[SHIELD_VARIABLE] = str(os.getpid())
    warm = _warm_start(argv)
    if warm is not None:
        return _end_like(_follow_warm(*warm))
    child = os.fork()
    if child == 0:   # the worker: out of the launcher's reach, then the command
        try:
            os.setsid()
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"hvdlite: cannot run {argv[0]}: {exc.strerror}", file=sys.stderr)
        os._exit(127)

    _forward_signals(child)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    return _end_like(status)


def _warm_start(argv: list[str]):
    """The worker forked by this host's warm process (``(pid, connection)``), or None for a
    cold start (see :mod:`.warm_process`)."""
    from .warm_process import spawn
    found = spawn(argv)
    if isinstance(found, str):
        if os.environ.get("MPI_LOCALRANKID", "0") == "0":
            print(f"hvdlite: elastic: starting this worker cold: {found}", file=sys.stderr,
                  flush=True)
        return None
    return found


def _follow_warm(pid: int, connection) -> int:
    from .warm_process import follow
    _forward_signals(pid)
    return follow(pid, connection)


def _forward_signals(worker: int) -> None:
    """Pass the launcher's SIGTERM/SIGINT/SIGHUP on to the worker's session."""
    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(worker, signum)
        except (ProcessLookupError, PermissionError):
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)


def _end_like(status: int) -> int:
    """Exit the way the worker ended (``status`` as ``os.waitpid`` gives it)."""
    if os.WIFSIGNALED(status):   # end the way the worker ended
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
