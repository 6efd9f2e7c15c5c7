"""Per-rank output files for ``hvdlite run --output-filename DIR``, and timestamped output
lines for ``--prefix-output-with-timestamp``.

The launcher starts ``python -m hvdlite.runner.rank_output [--prefix-timestamp] DIR NP
command...`` on every rank instead of ``command...``.  This wrapper runs the command as its child
and copies the child's stdout and stderr both to the console (as without the option) and to
``DIR/rank.<rank>/stdout`` and ``.../stderr`` (DIR ``-``: no files), the rank zero-padded so that
the directories sort in rank order (Horovod's layout).  With ``--prefix-timestamp`` every line
(ended by ``\n`` or ``\r``) starts with Horovod's prefix ``<time.asctime()>[<rank>]<stdout>:``
(or ``<stderr>``), on the console and in the files, as horovodrun's Gloo mode writes it.  The
child is the MPI process: it inherits the environment and every file descriptor (MPICH's PMI
connection is one), dies with the wrapper, and its exit status is the wrapper's.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, Mapping, Sequence

from hvdlite.common.core import LAUNCHER_RANK_VARIABLES as RANK_VARIABLES
from .horovodrun_flags import WRAPPER_NO_FILES as NO_FILES
from .horovodrun_flags import WRAPPER_TIMESTAMP_FLAG as TIMESTAMP_FLAG
_CHUNK = 1 << 16
_PR_SET_PDEATHSIG = 1


def launcher_rank(environ: Mapping[str, str]) -> int:
    """This process's rank as the MPI launcher announced it; ValueError if none did."""
    for name in RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    raise ValueError(f"none of {', '.join(RANK_VARIABLES)} is set: --output-filename and "
                     f"--prefix-output-with-timestamp need a launcher that announces each "
                     f"process's rank (MPICH, Intel MPI, Open MPI).")


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


def timestamp_prefix(rank: int, stream: str) -> bytes:
    """Horovod's line prefix for ``--prefix-output-with-timestamp``:
    ``Mon Nov 30 10:00:00 2026[1]<stdout>:`` (``time.asctime`` of the local time)."""
    return f"{time.asctime(time.localtime())}[{rank}]<{stream}>:".encode()


class LinePrefixer:
    """Turns chunks of output into whole lines, each led by ``prefix()`` taken when the line
    is complete (a line ends at ``\n`` or ``\r``, so a progress bar's updates show at once);
    :meth:`finish` returns what is left of an unfinished last line."""

    def __init__(self, prefix: Callable[[], bytes]) -> None:
        self.prefix = prefix
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines in ``pending + chunk``, prefixed; the rest stays pending."""
        data, lines, start = self.pending + chunk, [], 0
        for index, byte in enumerate(data):
            if byte in (10, 13):   # \n, \r
                lines.append(self.prefix() + data[start:index + 1])
                start = index + 1
        self.pending = data[start:]
        return b"".join(lines)

    def finish(self) -> bytes:
        rest, self.pending = self.pending, b""
        return self.prefix() + rest if rest else b""


def _tee(source: BinaryIO, outs: Sequence[BinaryIO],
         prefixer: LinePrefixer | None = None) -> None:
    """Copy ``source`` to every stream of ``outs`` chunk by chunk until it closes (through
    ``prefixer``, line by line, when given)."""
    read = getattr(source, "read1", source.read)
    while True:
        chunk = read(_CHUNK)
        data = chunk if prefixer is None else (
            prefixer.feed(chunk) if chunk else prefixer.finish())
        for out in outs if data else ():
            try:
                out.write(data)
                out.flush()
            except (OSError, ValueError):   # a closed console must not stop the log (or v.v.)
                pass
        if not chunk:
            break


def run(base: str | None, np: int, command: Sequence[str],
        environ: Mapping[str, str] | None = None, timestamps: bool = False) -> int:
    """Run ``command`` with its output teed to the console and to this rank's files (none when
    ``base`` is None), each line prefixed with the time and rank when ``timestamps``; return
    its exit status (128 + N if signal N ended it)."""
    environ = os.environ if environ is None else environ
    rank = launcher_rank(environ)
    directory = None if base is None else rank_directory(base, rank, np)
    if directory is not None:
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
        with contextlib.ExitStack() as files:
            names = ("stdout", "stderr")
            logs = [[], []] if directory is None else [
                [files.enter_context(open(directory / name, "wb"))] for name in names]
            prefixers = [LinePrefixer(functools.partial(timestamp_prefix, rank, name))
                         if timestamps else None for name in names]
            return _run_teed(command, logs, prefixers, started, pending)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_teed(command: Sequence[str], logs: list, prefixers: list, started: list,
              pending: list) -> int:
    """Start the child (recorded in ``started``; ``pending`` signals are passed on at once) and
    copy its output until it exits; its exit status."""
    try:
        child = subprocess.Popen(list(command), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, close_fds=False,
                                 preexec_fn=_prepare_child)
    except OSError as exc:
        message = f"hvdlite: cannot start {command[0]}: {exc.strerror}\n".encode()
        for out in logs[1] + [sys.stderr.buffer]:
            out.write(message)
        return 127
    started.append(child)
    for signum in pending:
        child.send_signal(signum)
    consoles = (sys.stdout.buffer, sys.stderr.buffer)
    copiers = [threading.Thread(target=_tee, args=(source, [console] + log, prefixer))
               for source, console, log, prefixer
               in zip((child.stdout, child.stderr), consoles, logs, prefixers)]
    for copier in copiers:
        copier.start()
    status = child.wait()
    for copier in copiers:
        copier.join()
    return 128 - status if status < 0 else status


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hvdlite.runner.rank_output [--prefix-timestamp] DIR NP command ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    timestamps = argv[:1] == [TIMESTAMP_FLAG]
    argv = argv[1:] if timestamps else argv
    if len(argv) < 3 or not argv[1].isdigit():
        print(f"usage: python -m hvdlite.runner.rank_output [{TIMESTAMP_FLAG}] DIR NP "
              f"command ...", file=sys.stderr)
        return 2
    base = None if argv[0] == NO_FILES else argv[0]
    try:
        return run(base, int(argv[1]), argv[2:], timestamps=timestamps)
    except (ValueError, OSError) as exc:
        flag = "--output-filename" if base is not None else "--prefix-output-with-timestamp"
        print(f"hvdlite: {flag}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
