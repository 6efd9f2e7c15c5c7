"""Warm starts for elastic jobs: every worker after the first world is forked from a process
that has already imported the training script's libraries, instead of starting Python anew.

An MPI world cannot take in a new process, so each reset of an elastic job starts every worker
again (see ``hvdlite.runner.elastic``); most of that start is not hvdlite's but the script's
imports (``import torch`` and the ``torch._dynamo`` that torch's first optimizer imports take
5-15 s on a small machine).  So, on each host:

* the first worker that the MPI launcher starts there (through ``hvdlite.runner.elastic.shield``)
  also starts ``hvdlite.runner.elastic.warm_process`` as a process of its own, the host's *warm
  process*, which connects to
  the driver (it lives as long as the driver's connection) and listens on a Unix socket in the
  host's temporary directory;
* at ``hvd.init()`` and at its first ``commit()`` a worker sends it the names of the library
  modules it has loaded (those under the interpreter's own and site directories: never the
  script's own modules, hvdlite, or ``mpi4py.MPI``, whose import would start MPI); the warm
  process imports them, one between two requests;
* in every later world, the shield asks the warm process for its worker: it passes the
  command, environment, working directory and its standard streams and MPI launcher socket
  (``PMI_FD``) over the socket; the warm process forks, and the child becomes the worker:
  a session of its own, those descriptors, that environment, then the script run as
  ``__main__`` (``runpy``).  The warm process reports the child's pid, and its wait status when
  it ends, to the shield, which ends the same way.

A command that is not ``<this Python> script.py ...`` or ``<this Python> -m module ...``, a
warm process that cannot be reached, one with nothing preloaded yet (the first world), or one
whose imports started a Python thread (a fork would then not be safe) means a cold start, as
before.  ``HVDLITE_ELASTIC_WARM_START=0`` (in ``hvdlite run``'s environment) turns warm starts
off.

This module holds what the worker's side needs (what to preload, and telling the warm process)
and the protocol both sides speak over the socket; the warm process and the shield's side of
it are launcher-side, in ``hvdlite.runner.elastic.warm_process``, which runs as a script and
loads this file by its path: so this file imports nothing but the standard library.
"""
from __future__ import annotations

import os
import pickle
import socket
import struct
import sys
import tempfile
import time

# Set by the elastic driver in every worker's environment: the job's token, which names the
# socket; absent when warm starts are off.
WARM_VARIABLE = "HVDLITE_ELASTIC_WARM"
SWITCH_VARIABLE = "HVDLITE_ELASTIC_WARM_START"     # read by the driver: one of OFF turns
OFF = ("0", "false", "no", "off")                  # warm starts off
DRIVER_VARIABLE = "HVDLITE_ELASTIC_DRIVER"         # elastic_wire's names (this file imports
KEY_VARIABLE = "HVDLITE_ELASTIC_KEY"               # nothing of hvdlite; a test checks them)
# Set in every worker a warm process forked (it reports nothing: its modules are preloaded).
CHILD_VARIABLE = "HVDLITE_ELASTIC_WARM_CHILD"
REQUEST_SECONDS = 5.0     # a request that does not arrive whole in this time is dropped
PROBE_SECONDS = 10.0      # a forked probe that has not exited by then means: start cold
_HEADER = struct.Struct("!Q")
_MAX_FDS = 16
NEVER_PRELOAD = ("hvdlite", "mpi4py.MPI", "__main__", "__mp_main__")


# --- the socket and its messages ------------------------------------------------------------
def socket_path(token: str) -> str | None:
    """Where the warm process of job ``token`` listens on this host (None if too long)."""
    path = os.path.join(tempfile.gettempdir(), f"hvdlite-warm-{token}.sock")
    return path if len(os.fsencode(path)) < 100 else None


def send_message(sock: socket.socket, message: object, fds: list[int] | None = None) -> None:
    """Send one message (pickled, length first) over the warm-start socket, with ``fds``."""
    data = pickle.dumps(message)
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [payload], fds)
        payload = payload[sent:]
    if payload:
        sock.sendall(payload)


def recv_message(sock: socket.socket, want_fds: bool = False) -> tuple[object, list[int]]:
    """One message (and the descriptors that came with it); EOFError at the end."""
    fds: list[int] = []
    if want_fds:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, _MAX_FDS)
    else:
        data = sock.recv(1 << 16)
    buf = bytearray(data)
    if not buf:
        raise EOFError("the other side closed the connection")
    while len(buf) < _HEADER.size:
        _read_more(sock, buf)
    (size,) = _HEADER.unpack_from(buf)
    while len(buf) < _HEADER.size + size:
        _read_more(sock, buf)
    return pickle.loads(bytes(buf[_HEADER.size:_HEADER.size + size])), fds


def _read_more(sock: socket.socket, buf: bytearray) -> None:
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise EOFError("the message ended early")
    buf.extend(chunk)


def connect(path: str, timeout: float | None = REQUEST_SECONDS) -> socket.socket:
    """A connection to the warm process listening at ``path`` (OSError if none)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


# --- the worker's side: what to preload -----------------------------------------------------
def library_modules(skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The modules of this process that come from the interpreter's own or site directories,
    in the order they were imported (the script's own modules, hvdlite and ``mpi4py.MPI`` are
    never preloaded), but for those in ``skip``."""
    import sysconfig
    roots = {os.path.realpath(p) + os.sep for p in
             {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}}
    names = []
    for name, module in list(sys.modules.items()):
        if name in skip or name.startswith(NEVER_PRELOAD) or module is None:
            continue
        where = getattr(module, "__file__", None)
        if where and any(os.path.realpath(where).startswith(root) for root in roots):
            names.append(name)
    return names


_reported: set[str] = set()
_finished = False   # the last report was made (or tried): later calls cost nothing


def report_modules(last: bool = False) -> None:
    """Tell this host's warm process which library modules to preload: those loaded since the
    last report.  ``hvd.init()`` reports what the script imported, and its first ``commit()``
    (``last``) what its setup added, e.g. torch's optimizers' ``torch._dynamo``; after that
    this returns at once, for it is called at every commit.  A worker forked warm, or a job
    without warm starts, sends nothing."""
    global _finished
    token = os.environ.get(WARM_VARIABLE)
    if _finished or not token or os.environ.get(CHILD_VARIABLE):
        return
    _finished = last
    path = socket_path(token)
    modules = library_modules(skip=_reported)
    if path is None or not modules:
        return
    try:
        with connect(path, timeout=2.0) as sock:
            send_message(sock, {"op": "preload", "modules": modules})
    except OSError:
        return   # no warm process on this host (yet): told at the next report, if any
    _reported.update(modules)



# --- both sides: a process that is not this one's child ----------------------------------
def wait_for_exit(pid: int) -> None:
    """Return once process ``pid``, which need not be a child of this one, has ended."""
    try:
        import select
        fd = os.pidfd_open(pid)   # readable once the process has ended
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        return
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(0.2)
