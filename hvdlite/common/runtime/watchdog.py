"""Noticing a rank that ends without ``hvd.shutdown()``, on any host, within seconds.

A rank can end without a word: ``os._exit``, a C library's ``exit()``, a signal, the
out-of-memory killer, its whole host going down.  MPI does not say so (MPICH's Hydra tears the
job down when a process dies of a signal, but not when it exits with a code, and a host that
vanishes leaves the others blocked), and the node-local check in :mod:`liveness` sees only
ranks on the same host.  So every rank keeps one TCP connection to rank 0, made at ``init()``:

* a process that ends for any reason has its sockets closed by its kernel, so rank 0 reads the
  end of the connection at once; a clean ``shutdown()`` first says ``BYE``, so only an
  unannounced end counts as a death;
* a host that vanishes sends nothing more: TCP keepalive (probes after 2 s of silence, every
  second, 3 unanswered) makes the kernel fail the connection within about 5 s;
* rank 0 tells every other rank which rank (and host) is gone; if rank 0 itself goes, every
  rank reads the end of its own connection.

Each side's socket is watched by one thread that sleeps in ``select`` (no work in the steady
state: no heartbeats, no messages, nothing on the training path).  Rank 0 holds ``size - 1``
connections (epoll-based, so thousands of ranks are fine); a death costs one short message to
each surviving rank.  The listener passed to :func:`Watchdog.start` is called, on the watch
thread, with every departure; the runtime fails the operations waiting on the departed rank.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
import weakref
from typing import Callable, NamedTuple

log = logging.getLogger("hvdlite")

CONNECT_SECONDS = 30.0      # every rank reaches rank 0's watchdog within this, or init fails
KEEPALIVE = (2, 1, 3)       # TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT (seconds, seconds, probes)
_BYE = b"BYE\n"


class Departure(NamedTuple):
    rank: int
    host: str
    how: str    # what is known of it: "exited" or "unreachable"

    def describe(self) -> str:
        if self.how == "unreachable":
            return (f"rank {self.rank} on host {self.host} stopped answering (its host may be "
                    f"down or cut off)")
        return (f"rank {self.rank} on host {self.host} exited without shutting down hvdlite "
                f"(killed, os._exit, exit() in native code, or the out-of-memory killer)")


Listener = Callable[[list[Departure]], None]


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval),
                          ("TCP_KEEPCNT", count)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Watchdog:
    """One rank's side.  ``start`` is collective over the world communicator; ``close`` says
    goodbye (a clean end) and stops the thread."""

    def __init__(self, rank: int, size: int, listener: Listener) -> None:
        self.rank = rank
        self.size = size
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._hosts: dict[int, str] = {}          # rank -> host name, as each rank reported it
        self._peers: dict[socket.socket, int] = {}   # rank 0: connection -> the rank on it
        self._buffers: dict[socket.socket, bytes] = {}
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self.departed: list[Departure] = []
        _live.add(self)

    # --- setting up --------------------------------------------------------------------------
    def start(self, world, port: int = 0) -> None:
        """Connect every rank to rank 0 (collective).  Raises ``RuntimeError`` on every rank if
        some rank cannot reach it, naming the ranks, hosts and address."""
        host = socket.gethostname()
        problem = None
        listener = None
        address = None
        if self.rank == 0:
            try:
                listener = socket.create_server(("", port), backlog=min(self.size, 4096))
                address = (host, listener.getsockname()[1])
            except OSError as exc:
                problem = f"rank 0 could not listen on port {port}: {exc}"
        address, root_problem = world.bcast((address, problem), root=0)
        if root_problem is None and self.rank != 0:
            problem = self._connect(address, host)
        elif root_problem is None:
            problem = self._accept_all(listener, host)
        if listener is not None:
            listener.close()
        problems = world.allgather(problem)
        if any(problems):
            self._shut_sockets()
            bad = {r: p for r, p in enumerate(problems) if p}
            raise RuntimeError(
                f"hvd.init(): the watchdog (which tells every rank when another one ends "
                f"without hvd.shutdown()) could not connect every rank to rank 0 at "
                f"{address[0] if address else '?'}:{address[1] if address else '?'}: "
                + "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items()))
                + ". Open that TCP port between the hosts (choose it with "
                  "HVDLITE_WATCHDOG_PORT), or set HVDLITE_WATCHDOG=0 to run without it.")
        self._hosts = dict(enumerate(world.allgather(host)))
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._watch, name="hvdlite-watchdog",
                                        daemon=True)
        self._thread.start()

    def _connect(self, address: tuple[str, int], host: str) -> str | None:
        deadline = time.monotonic() + CONNECT_SECONDS
        error = None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection(address, timeout=5.0)
                break
            except OSError as exc:   # rank 0 may not be listening yet on a slow start
                error = exc
                time.sleep(0.2)
        else:
            return f"cannot connect from host {host}: {error}"
        _keepalive(sock)
        sock.sendall(f"HELLO {self.rank}\n".encode())
        sock.setblocking(False)
        self._peers[sock] = 0
        self._selector.register(sock, selectors.EVENT_READ)
        return None

    def _accept_all(self, listener: socket.socket, host: str) -> str | None:
        deadline = time.monotonic() + CONNECT_SECONDS
        while len(self._peers) < self.size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.size)) - set(self._peers.values()))
                return f"ranks {missing} did not connect within {CONNECT_SECONDS:g} s"
            listener.settimeout(min(left, 1.0))
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(64)
                if not chunk:
                    break
                data += chunk
            if not data.startswith(b"HELLO "):
                sock.close()
                continue
            _keepalive(sock)
            sock.setblocking(False)
            self._peers[sock] = int(data.split()[1])
            self._selector.register(sock, selectors.EVENT_READ)
        return None

    # --- the watch thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            for key, _ in self._selector.select():
                sock = key.fileobj
                if sock is self._wake_r:
                    return
                self._readable(sock)

    def _readable(self, sock: socket.socket) -> None:
        rank = self._peers.get(sock)
        try:
            data = sock.recv(4096)
            how = "exited"
        except (ConnectionResetError, BrokenPipeError):
            data, how = b"", "exited"
        except TimeoutError:    # keepalive probes unanswered: the host is gone
            data, how = b"", "unreachable"
        except OSError:
            data, how = b"", "unreachable"
        if data:
            buf = self._buffers.get(sock, b"") + data
            lines, _, rest = buf.rpartition(b"\n")
            self._buffers[sock] = rest
            for line in lines.split(b"\n"):
                self._message(sock, rank, line.decode(errors="replace").split())
            return
        self._drop(sock)
        if rank is None or self._closing:
            return
        if self.rank == 0:
            self._gone([Departure(rank, self._hosts.get(rank, "?"), how)])
        else:   # rank 0 is gone: nobody will tell the others, each rank sees it itself
            self._gone([Departure(0, self._hosts.get(0, "?"), how)])

    def _message(self, sock: socket.socket, rank: int | None, words: list[str]) -> None:
        if not words:
            return
        if words[0] == "BYE":         # a clean shutdown: no longer watched
            self._drop(sock)
        elif words[0] == "GONE" and self.rank != 0:
            self._gone([Departure(int(words[1]), self._hosts.get(int(words[1]), "?"),
                                  words[2] if len(words) > 2 else "exited")], relay=False)

    def _drop(self, sock: socket.socket) -> None:
        self._peers.pop(sock, None)
        self._buffers.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _gone(self, departures: list[Departure], relay: bool = True) -> None:
        departures = [d for d in departures if d not in self.departed]
        if not departures:
            return
        self.departed.extend(departures)
        if relay and self.rank == 0:   # tell every surviving rank
            message = b"".join(f"GONE {d.rank} {d.how}\n".encode() for d in departures)
            for sock in list(self._peers):
                try:
                    sock.sendall(message)
                except OSError:
                    pass   # that one is going too: its own end will be read next
        for d in departures:
            log.error("hvdlite: %s.", d.describe())
        try:
            self._listener(departures)
        except Exception:   # noqa: BLE001 - the watch must go on
            log.exception("hvdlite: handling a departed rank failed")

    # --- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """A clean end: tell rank 0 (or, on rank 0, everyone) and stop watching."""
        self._closing = True
        for sock in list(self._peers):
            try:
                sock.setblocking(True)
                sock.settimeout(1.0)
                sock.sendall(_BYE)
            except OSError:
                pass
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._shut_sockets()

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the sockets without a word (the
        parent's connections stay open; a child holding them would hide the parent's end)."""
        for sock in [*self._peers, self._wake_r, self._wake_w]:
            try:
                sock.close()
            except OSError:
                pass
        self._peers.clear()
        _live.discard(self)

    def _shut_sockets(self) -> None:
        for sock in list(self._peers):
            try:
                sock.close()
            except OSError:
                pass
        self._peers.clear()
        for sock in (self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        try:
            self._selector.close()
        except Exception:   # noqa: BLE001 - best effort at teardown
            pass
        _live.discard(self)


_live: "weakref.WeakSet[Watchdog]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for watchdog in list(_live):
        watchdog.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
