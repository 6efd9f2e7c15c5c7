"""The warm process of an elastic job's host, and the shield's side of it: every worker after
the first world is forked from a process that has already imported the training script's
libraries (see ``hvdlite.common.runtime.warm_start`` for the whole story and the worker's side).

* :func:`spawn` and :func:`follow`: the shield (:mod:`.shield`) asks the host's warm process for
  its worker, starting the warm process when there is none yet, and waits for the worker's end;
* :class:`WarmProcess` and :func:`main`: the warm process itself, run as a script
  (``python warm_process.py TOKEN``) so that it imports nothing of hvdlite: only the standard
  library, the protocol it shares with the workers (``warm_start.py``, loaded by its path) and
  the modules it is told to preload.
"""
from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time

if __name__ == "__main__":   # the warm process: the protocol by its path, not hvdlite's package
    import importlib.util
    _spec = importlib.util.spec_from_file_location(
        "hvdlite_warm_protocol", os.path.join(os.path.dirname(os.path.realpath(__file__)),
                                              "..", "..", "common", "runtime", "warm_start.py"))
    protocol = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(protocol)
else:
    from hvdlite.common.core import warm_start as protocol


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
    token = os.environ.get(protocol.WARM_VARIABLE)
    if not token or not python_command(argv):
        return None
    path = protocol.socket_path(token)
    if path is None:
        return f"the socket path in {tempfile.gettempdir()} would be too long"
    try:
        sock = protocol.connect(path)
    except OSError:
        _start_warm_process(token, path)
        return None
    try:
        targets = [0, 1, 2]
        pmi = os.environ.get("PMI_FD", "")
        if pmi.isdigit() and int(pmi) not in targets:
            targets.append(int(pmi))
        protocol.send_message(sock, {"op": "spawn", "argv": argv, "env": dict(os.environ),
                                     "cwd": os.getcwd(), "targets": targets}, targets)
        # The warm process may first probe whether a fork is safe (up to PROBE_SECONDS): a
        # shield that gave up sooner would start the worker cold while it forks one too.
        sock.settimeout(protocol.REQUEST_SECONDS + protocol.PROBE_SECONDS)
        reply, _ = protocol.recv_message(sock)
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
            message, _ = protocol.recv_message(sock)
            if message[0] == "exit":
                return message[1]
    except (OSError, EOFError):
        pass
    protocol.wait_for_exit(pid)   # the warm process is gone: the worker is not ours to wait for
    return 1 << 8


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
        if name.startswith(protocol.NEVER_PRELOAD):
            raise ImportError(f"{name} is imported by the worker itself")
        return None


class WarmProcess:
    """The host's warm process: preloads, forks workers on request, and reaps them."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.path = protocol.socket_path(token)
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
        host, port = os.environ[protocol.DRIVER_VARIABLE].rsplit(":", 1)
        driver = Client((host, int(port)), authkey=bytes.fromhex(os.environ[protocol.KEY_VARIABLE]))
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
        conn.settimeout(protocol.REQUEST_SECONDS)
        try:
            message, fds = protocol.recv_message(conn, want_fds=True)
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
            protocol.send_message(conn, ("cold", ""))
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
            protocol.send_message(conn, ("cold", self.cold_reason))
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        if _gone(conn):   # the shield gave up waiting and started its worker cold
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
            protocol.send_message(conn, ("pid", pid))
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
        deadline = time.monotonic() + protocol.PROBE_SECONDS
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return (f"a process forked from the warm process did not finish exiting within "
                        f"{protocol.PROBE_SECONDS:g} s (a preloaded library waits there for state "
                        f"a fork does not copy)")
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
                    protocol.send_message(conn, ("exit", status))
                except OSError:
                    pass   # its shield is gone (the launcher tore the world down)
                conn.close()

    def _preload(self, modules: list[str]) -> None:
        """Queue ``modules`` (in import order) behind those still pending."""
        self.told = True
        fresh = [m for m in modules
                 if not m.startswith(protocol.NEVER_PRELOAD) and m not in sys.modules]
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


def _gone(conn: socket.socket) -> bool:
    """Whether the peer of ``conn`` has closed it (it sends nothing more after its request)."""
    import select
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


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
    os.environ[protocol.CHILD_VARIABLE] = "1"
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
    request = WarmProcess(token).serve()
    if request is None:
        return 0
    _become_worker(request)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
