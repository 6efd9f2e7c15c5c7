"""Per-rank output files for ``hvdlite run --output-filename DIR``.

The launcher starts ``python -m hvdlite.runner.rank_output DIR NP command...`` on every rank
instead of ``command...``.  This wrapper runs the command as its child and copies the child's
stdout and stderr both to the console (as without the option) and to
``DIR/rank.<rank>/stdout`` and ``.../stderr``, the rank zero-padded so that the directories sort
in rank order (Horovod's layout).  The child is the MPI process: it inherits the environment and
every file descriptor (MPICH's PMI connection is one), dies with the wrapper, and its exit
status is the wrapper's.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import BinaryIO, Mapping, Sequence

from hvdlite.common.core import LAUNCHER_RANK_VARIABLES as RANK_VARIABLES
_CHUNK = 1 << 16
_PR_SET_PDEATHSIG = 1


def launcher_rank(environ: Mapping[str, str]) -> int:
    """This process's rank as the MPI launcher announced it; ValueError if none did."""
    for name in RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    raise ValueError(f"none of {', '.join(RANK_VARIABLES)} is set: --output-filename needs a "
                     f"launcher that announces each process's rank (MPICH, Intel MPI, Open MPI).")


def rank_directory(base: str | os.PathLike, rank: int, np: int) -> Path:
    """``base/rank.<rank>``, the rank padded with zeros to the width of the largest rank."""
    width = len(str(max(np - 1, 0)))
    return Path(base) / f"rank.{rank:0{width}d}"


def _prepare_child() -> None:
    """In the child before exec: its own process group, so that a signal sent to the wrapper's
    group reaches it once (forwarded by the wrapper), not twice; and death with the wrapper (a
    launcher that SIGKILLs the wrapper must not leave the training process running)."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):   # not Linux: the child may outlive a killed wrapper
        pass


def _tee(source: BinaryIO, console: BinaryIO, log: BinaryIO) -> None:
    """Copy ``source`` to ``console`` and ``log`` chunk by chunk until it closes."""
    read = getattr(source, "read1", source.read)
    while True:
        chunk = read(_CHUNK)
        if not chunk:
            break
        for out in (console, log):
            try:
                out.write(chunk)
                out.flush()
            except (OSError, ValueError):   # a closed console must not stop the log (or v.v.)
                pass


def run(base: str, np: int, command: Sequence[str],
        environ: Mapping[str, str] | None = None) -> int:
    """Run ``command`` with its output teed to the console and to this rank's files; return
    its exit status (128 + N if signal N ended it)."""
    environ = os.environ if environ is None else environ
    directory = rank_directory(base, launcher_rank(environ), np)
    directory.mkdir(parents=True, exist_ok=True)
    started: list[subprocess.Popen] = []
    pending: list[int] = []   # signals that came before the child existed

    def forward(signum: int, _frame: object) -> None:
        if started:
            started[0].send_signal(signum)
        else:
            pending.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run_teed(command, directory, started, pending)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_teed(command: Sequence[str], directory: Path, started: list, pending: list) -> int:
    """Start the child (recorded in ``started``; ``pending`` signals are passed on at once) and
    copy its output until it exits; its exit status."""
    with open(directory / "stdout", "wb") as out_log, open(directory / "stderr", "wb") as err_log:
        try:
            child = subprocess.Popen(list(command), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, close_fds=False,
                                     preexec_fn=_prepare_child)
        except OSError as exc:
            message = f"hvdlite: cannot start {command[0]}: {exc.strerror}\n".encode()
            err_log.write(message)
            sys.stderr.buffer.write(message)
            return 127
        started.append(child)
        for signum in pending:
            child.send_signal(signum)
        copiers = [threading.Thread(target=_tee, args=(child.stdout, sys.stdout.buffer, out_log)),
                   threading.Thread(target=_tee, args=(child.stderr, sys.stderr.buffer, err_log))]
        for copier in copiers:
            copier.start()
        status = child.wait()
        for copier in copiers:
            copier.join()
    return 128 - status if status < 0 else status


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or not argv[1].isdigit():
        print("usage: python -m hvdlite.runner.rank_output DIR NP command ...", file=sys.stderr)
        return 2
    try:
        return run(argv[0], int(argv[1]), argv[2:])
    except (ValueError, OSError) as exc:
        print(f"hvdlite: --output-filename: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
