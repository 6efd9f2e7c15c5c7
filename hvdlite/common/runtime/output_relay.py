"""An elastic worker's stdout and stderr, kept alive when its world's launcher is gone.

A worker's standard streams are pipes to the MPI launcher's proxy on its host.  When a world
fails, the launcher tears it down, proxies included, possibly before a surviving rank has
noticed the failure; that rank's next write (a progress bar's last refresh, a log line, a
``print`` in ``finally``) then raises ``BrokenPipeError``, which replaces the collective's
``HorovodInternalError`` and ends the job as if the script had failed.  So in an elastic worker
descriptors 1 and 2 become pipes read by one thread of this process (:func:`install`), which
copies everything to the launcher's pipes while they last, and from then on hands it to a
fallback (the elastic driver, which prints it).  Nothing the script writes is lost or raises,
whatever the launcher does.  At exit (and before ``os._exit`` in hvdlite's own exits,
:func:`drain`) what is in the pipes is copied out first.
"""
from __future__ import annotations

import atexit
import errno
import os
import sys
import threading
from typing import Callable, Optional

CHUNK = 65536
DRAIN_SECONDS = 2.0
_BROKEN = (errno.EPIPE, errno.EIO, errno.EBADF, errno.ECONNRESET)

Fallback = Callable[[int, bytes], None]   # (descriptor 1 or 2, data)


class _Stream:
    """One descriptor's relay: ``fd`` writes into a pipe; a thread copies the pipe to
    ``target`` (the launcher's pipe) or, once that breaks, to the fallback."""

    def __init__(self, fd: int, fallback: Fallback) -> None:
        self.fd = fd
        self.target = os.dup(fd)
        self.fallback = fallback
        self.broken = False
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self._read = read
        self.thread = threading.Thread(target=self._copy, name=f"hvdlite-output-{fd}",
                                       daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        while True:
            try:
                data = os.read(self._read, CHUNK)
            except InterruptedError:
                continue
            if not data:
                break
            self._write(data)
        os.close(self._read)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self.broken:
            try:
                view = view[os.write(self.target, view):]
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno not in _BROKEN:
                    raise
                self.broken = True
        if view:
            try:
                self.fallback(self.fd, bytes(view))
            except Exception:  # noqa: BLE001 - output must never fail the script
                pass

    def restore(self) -> None:
        """Point ``fd`` back at the launcher's pipe (at /dev/null when that broke, so that
        the interpreter's last flush cannot fail the exit), which ends the copying thread
        once it has copied what is in the pipe."""
        if self.broken:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.fd)
            os.close(null)
        else:
            os.dup2(self.target, self.fd)


_streams: list[_Stream] = []
_lock = threading.Lock()


def install(fallback: Fallback) -> None:
    """Relay descriptors 1 and 2 of this process (once; see the module docstring).
    ``fallback(fd, data)`` takes what cannot reach the launcher any more."""
    with _lock:
        if _streams:
            return
        _flush()
        for fd in (1, 2):
            _streams.append(_Stream(fd, fallback))
        atexit.register(drain)   # registered first among hvdlite's: it runs after them
        os.register_at_fork(after_in_child=_forget_in_child)


def drain() -> None:
    """Copy out everything written so far and give descriptors 1 and 2 back (the process is
    about to end).  Safe to call more than once."""
    with _lock:
        streams = list(_streams)
        _streams.clear()
    if not streams:
        return
    _flush()
    for stream in streams:
        stream.restore()
    for stream in streams:
        stream.thread.join(DRAIN_SECONDS)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or replaced stream
            pass


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) writes into the parent's pipes, which the
    parent's thread copies; it has no thread of its own to drain."""
    _streams.clear()
