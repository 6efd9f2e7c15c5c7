"""Warm starts for elastic jobs: every worker after the first world is forked from a process
that has already imported the training script's libraries, instead of starting Python anew.

An MPI world cannot take in a new process, so each reset of an elastic job starts every worker
again (see ``hvdlite.runner.elastic``); most of that start is not hvdlite's but the script's
imports (``import torch`` and the ``torch._dynamo`` that torch's first optimizer imports take
5-15 s on a small machine).  So, on each host:

* the first worker that the MPI launcher starts there (through ``hvdlite.runner.elastic.shield``)
  also starts this module as a process of its own, the host's *warm process*, which connects to
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

This file runs as a script (``python warm_start.py TOKEN``) so that the warm process imports
nothing of hvdlite: only the standard library and the modules it is told to preload.
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
_NEVER_PRELOAD = ("hvdlite", "mpi4py.MPI", "__main__", "__mp_main__")


# --- the socket and its messages ------------------------------------------------------------
def socket_path(token: str) -> str | None:
    """Where the warm process of job ``token`` listens on this host (None if too long)."""
    path = os.path.join(tempfile.gettempdir(), f"hvdlite-warm-{token}.sock")
    return path if len(os.fsencode(path)) < 100 else None


def _send(sock: socket.socket, message: object, fds: list[int] | None = None) -> None:
    data = pickle.dumps(message)
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [payload], fds)
        payload = payload[sent:]
    if payload:
        sock.sendall(payload)


def _recv(sock: socket.socket, want_fds: bool = False) -> tuple[object, list[int]]:
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
        _more(sock, buf)
    (size,) = _HEADER.unpack_from(buf)
    while len(buf) < _HEADER.size + size:
        _more(sock, buf)
    return pickle.loads(bytes(buf[_HEADER.size:_HEADER.size + size])), fds


def _more(sock: socket.socket, buf: bytearray) -> None:
    chunk = sock.recv(1 << 16)
    if not chunk:
        raise EOFError("the message ended early")
    buf.extend(chunk)


def _connect(path: str, timeout: float | None = REQUEST_SECONDS) -> socket.socket:
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
        if name in skip or name.startswith(_NEVER_PRELOAD) or module is None:
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
        with _connect(path, timeout=2.0) as sock:
            _send(sock, {"op": "preload", "modules": modules})
    except OSError:
        return   # no warm process on this host (yet): told at the next report, if any
    _reported.update(modules)


# --- the shield's side: ask for a worker -----------------------------------------------------
def python_command(argv: list[str]) -> bool:
    """Whether ``argv`` runs a script or module with this very interpreter (the only commands
    a warm process can take over)."""
    if len(argv) < 2:
        return False
    import shutil
    found = shutil.which(argv[0]) if os.sep not in argv[0] else argv[0]
    try:   # the same binary in the same folder (a venv's python, not the one it links to)
        if not found or not os.path.samefile(found, sys.executable) or (
                os.path.dirname(os.path.abspath(found))
                != os.path.dirname(os.path.abspath(sys.executable))):
            return False
    except OSError:
        return False
    rest = argv[1:]
    if rest[0] == "-u":
        rest = rest[1:]
    if not rest:
        return False
    return (rest[0] == "-m" and len(rest) >= 2) or not rest[0].startswith("-")


def spawn(argv: list[str]) -> tuple[int, socket.socket] | str | None:
    """Ask this host's warm process to fork the worker ``argv``: ``(pid, connection)`` (the
    connection then brings ``("exit", wait status)``), a reason why not (say it), or None (start
    cold: the warm process is not there yet, and is started now, or has nothing to offer yet,
    as in the job's first world)."""
    token = os.environ.get(WARM_VARIABLE)
    if not token or not python_command(argv):
        return None
    path = socket_path(token)
    if path is None:
        return f"the socket path in {tempfile.gettempdir()} would be too long"
    try:
        sock = _connect(path)
    except OSError:
        _start_warm_process(token, path)
        return None
    try:
        targets = [0, 1, 2]
        pmi = os.environ.get("PMI_FD", "")
        if pmi.isdigit() and int(pmi) not in targets:
            targets.append(int(pmi))
        _send(sock, {"op": "spawn", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                     "targets": targets}, targets)
        reply, _ = _recv(sock)
    except (OSError, EOFError) as exc:
        sock.close()
        return f"the warm process did not answer ({exc})"
    if reply[0] == "pid":
        sock.settimeout(None)
        return reply[1], sock
    sock.close()
    return str(reply[1]) or None


def follow(pid: int, sock: socket.socket) -> int:
    """Wait for the warm-started worker ``pid`` to end; its wait status (as ``os.waitpid``
    gives it; an exit status of 1 if the warm process went away first)."""
    try:
        while True:
            message, _ = _recv(sock)
            if message[0] == "exit":
                return message[1]
    except (OSError, EOFError):
        pass
    wait_for_exit(pid)   # the warm process is gone: the worker is not ours to wait for
    return 1 << 8


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


def _start_warm_process(token: str, path: str) -> None:
    """Start the host's warm process unless another worker is starting it."""
    import subprocess
    try:
        lock = os.open(path + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return   # another worker of this host is starting it (or did)
    os.close(lock)
    env = dict(os.environ)
    env.pop("PMI_FD", None)
    try:
        subprocess.Popen([sys.executable, os.path.abspath(__file__), token], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True,
                         cwd="/")
    except OSError:
        os.unlink(path + ".lock")


# --- the warm process -------------------------------------------------------------------------
class _Blocker:
    """While preloading: modules that must be imported in the worker itself refuse."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.startswith(_NEVER_PRELOAD):
            raise ImportError(f"{name} is imported by the worker itself")
        return None


class _WarmProcess:
    def __init__(self, token: str) -> None:
        self.token = token
        self.path = socket_path(token)
        self.children: dict[int, socket.socket] = {}
        self.accepting = True
        self.pending: list[str] = []   # modules still to import, in order (one per turn)
        self.told = False              # a worker has said what to preload
        self.cold_reason: str | None = None
        self.probed = -1               # len(sys.modules) when a fork was last found safe
        self.listener: socket.socket | None = None
        self.driver = None

    def serve(self) -> dict | None:
        """Serve until the driver is gone and every child has ended (None), or, in a forked
        child, return the spawn request it is to run."""
        import selectors
        from multiprocessing.connection import Client
        host, port = os.environ[DRIVER_VARIABLE].rsplit(":", 1)
        driver = Client((host, int(port)), authkey=bytes.fromhex(os.environ[KEY_VARIABLE]))
        driver.send(("warm", socket.gethostname(), os.getpid()))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener, self.driver = listener, driver
        old_umask = os.umask(0o077)
        try:
            if os.path.exists(self.path):
                os.unlink(self.path)
            listener.bind(self.path)
        finally:
            os.umask(old_umask)
        listener.listen(128)
        self._exit_with_driver(driver.fileno())
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, "listener")
        selector.register(driver.fileno(), selectors.EVENT_READ, "driver")
        try:
            while self.accepting or self.children:
                for key, _ in selector.select(timeout=0 if self.pending else 0.1):
                    if key.data == "driver":
                        self.accepting = False   # the job is over: serve no one new
                        selector.unregister(driver.fileno())
                        selector.unregister(listener)
                        listener.close()
                        self._unlink()
                    elif key.data == "listener" and self.accepting:
                        request = self._accept(listener)
                        if request is not None:   # a forked child: become the worker
                            selector.close()
                            return request
                self._reap()
                if self.pending:   # between requests, so a worker never waits for all of it
                    self._preload_next()
        except BaseException:
            self._unlink()
            raise
        if self.accepting:
            self._unlink()
        return None

    def _exit_with_driver(self, fd: int) -> None:
        """The driver only ever closes this connection: have the kernel signal that (SIGIO),
        so that the warm process ends at once even in the middle of a long import."""
        import fcntl
        import signal

        def driver_gone(_signum: int, _frame: object) -> None:
            import select
            if not self.children and select.select([fd], [], [], 0)[0]:
                self._unlink()
                os._exit(0)

        signal.signal(signal.SIGIO, driver_gone)
        try:
            fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
        except OSError:
            pass   # it is noticed between imports instead

    def _unlink(self) -> None:
        for path in (self.path, self.path + ".lock"):
            try:
                os.unlink(path)
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> dict | None:
        conn, _ = listener.accept()
        conn.settimeout(REQUEST_SECONDS)
        try:
            message, fds = _recv(conn, want_fds=True)
        except (OSError, EOFError, pickle.UnpicklingError):
            conn.close()
            return None
        if message.get("op") == "preload":
            conn.close()
            self._preload(message["modules"])
            return None
        if message.get("op") != "spawn" or len(fds) != len(message["targets"]):
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        import threading
        if not self.told:   # nothing to preload yet: a fork would gain nothing over a start
            _send(conn, ("cold", ""))
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        if self.cold_reason is None and threading.active_count() > 1:
            self.cold_reason = (f"the preloaded modules started {threading.active_count() - 1} "
                                f"Python thread(s), so forking workers would not be safe")
        if self.cold_reason is None and self.probed != len(sys.modules):
            self.cold_reason = self._fork_probe()
            self.probed = len(sys.modules)
        if self.cold_reason is not None:
            _send(conn, ("cold", self.cold_reason))
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:   # the worker: keep nothing of the warm process's connections
            for other in [conn, self.listener, *self.children.values()]:
                other.close()
            self.driver.close()
            message["fds"] = fds
            return message
        for fd in fds:
            os.close(fd)
        try:
            _send(conn, ("pid", pid))
        except OSError:
            pass
        self.children[pid] = conn
        return None

    def _fork_probe(self) -> str | None:
        """Why forking workers is not safe with what is preloaded now, or None: a child forked
        here ends the way a worker's process ends (Python's exit functions, then the C and C++
        ones: static destructors). A library that keeps native threads or locks which a fork
        does not copy whole (a ``std::thread`` object without its thread: "terminate called
        without an active exception") kills such a child with a signal, where a cold start
        would not."""
        import signal
        pid = os.fork()
        if pid == 0:
            try:
                import atexit
                import ctypes
                atexit._run_exitfuncs()
                ctypes.CDLL(None).exit(0)   # the C library's exit: its handlers, destructors
            finally:
                os._exit(0)
        deadline = time.monotonic() + PROBE_SECONDS
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return (f"a process forked from the warm process did not finish exiting within "
                        f"{PROBE_SECONDS:g} s (a preloaded library waits there for state a "
                        f"fork does not copy)")
            time.sleep(0.005)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            return (f"a process forked from the warm process died of "
                    f"{signal.Signals(sig).name} when it exited (a preloaded library keeps "
                    f"native state a fork does not copy whole, e.g. a thread object without "
                    f"its thread)")
        if os.waitstatus_to_exitcode(status) != 0:
            return (f"a process forked from the warm process exited with status "
                    f"{os.waitstatus_to_exitcode(status)} when it should have exited cleanly")
        return None

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, ("exit", status))
                except OSError:
                    pass   # its shield is gone (the launcher tore the world down)
                conn.close()

    def _preload(self, modules: list[str]) -> None:
        """Queue ``modules`` (in import order) behind those still pending."""
        self.told = True
        fresh = [m for m in modules if not m.startswith(_NEVER_PRELOAD) and m not in sys.modules]
        self.pending[:0] = reversed(fresh)   # popped from the end: oldest first

    def _preload_next(self) -> None:
        """Import the next module not imported yet (a worker forked meanwhile imports the rest
        itself)."""
        import importlib
        while self.pending:
            name = self.pending.pop()
            if name in sys.modules:
                continue
            sys.meta_path.insert(0, _Blocker)
            try:
                importlib.import_module(name)
            except BaseException:   # noqa: BLE001 - the worker imports it itself
                pass
            finally:
                sys.meta_path.remove(_Blocker)
            return


def _become_worker(request: dict) -> None:
    """In the forked child: take the shield's descriptors, environment and directory, then
    run the command as ``__main__``; the interpreter's exit is the worker's."""
    import runpy
    import signal
    os.setsid()
    for target, fd in zip(request["targets"], request["fds"]):
        if fd != target:
            os.dup2(fd, target)
    for fd in request["fds"]:
        if fd not in request["targets"]:
            os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGIO):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[CHILD_VARIABLE] = "1"
    os.chdir(request["cwd"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:   # a cold process seeds numpy's global generator from the OS
        numpy.random.seed()   # (Python's random reseeds itself after a fork)
    argv = list(request["argv"][1:])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    if argv[0] == "-u":
        argv, unbuffered = argv[1:], True
    _reopen_streams(unbuffered)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0:0] = [os.getcwd()]
        runpy._run_module_as_main(argv[1], alter_argv=True)   # what ``python -m`` does
    else:
        sys.argv = argv
        sys.path[0:0] = [os.path.dirname(os.path.realpath(argv[0]))]
        runpy.run_path(argv[0], run_name="__main__")


def _reopen_streams(unbuffered: bool) -> None:
    import io
    for fd, name, mode in ((0, "stdin", "rb"), (1, "stdout", "wb"), (2, "stderr", "wb")):
        raw = open(fd, mode, buffering=0, closefd=False)
        if mode == "rb":
            stream = io.TextIOWrapper(io.BufferedReader(raw), line_buffering=False)
        else:
            stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw),
                                      line_buffering=True, write_through=unbuffered,
                                      errors="backslashreplace" if name == "stderr" else None)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def main(token: str) -> int:
    if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
        del sys.path[0]   # this file's folder is hvdlite's own, not a place to import from
    request = _WarmProcess(token).serve()
    if request is None:
        return 0
    _become_worker(request)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
