"""The elastic driver's listener: every worker's connection, and the last commit.

Each worker connects at ``hvd.init()`` (see ``hvdlite.common.runtime.elastic_channel``) and
gets a thread here that reads its messages: hello (who and where), commits (stored as the raw
frames they came in: the driver never unpickles a state), fetches of the newest commit, offers
of a failing rank's commit ("have"), the rank's outcome when its world ends, and what a rank
writes once its world's launcher (which carried its output) is gone ("output").  Membership
news (hello, outcome, a connection that ended) goes to the driver's loop as :class:`Event`\\ s;
commits are handled here, under :class:`CommitStore`'s lock.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import secrets
import socket
import sys
import threading
import time
from typing import Any

from hvdlite.common.core import elastic_wire as wire

log = logging.getLogger("hvdlite")

HAVE_WAIT_SECONDS = 60.0   # a failing rank waits this long for another one's upload


_output_lock = threading.Lock()


def _write_output(fd: int, data: bytes) -> None:
    """Print what a worker wrote to its stdout (``fd`` 1) or stderr (2) once its world's
    launcher, which carried its output until then, was gone (see output_relay)."""
    stream = sys.stdout if fd == 1 else sys.stderr
    with _output_lock:
        stream.flush()
        stream.buffer.write(data)
        stream.buffer.flush()


@dataclasses.dataclass
class Member:
    """One worker process of one world."""

    world: int
    rank: int
    size: int
    host: str
    pid: int
    conn: Any = dataclasses.field(repr=False, default=None)
    send_lock: threading.Lock = dataclasses.field(repr=False, default_factory=threading.Lock)
    in_session: bool = False        # it runs an hvd.elastic.run function (it will report)
    outcome: tuple | None = None    # (kind, text, departed ranks) as the worker reported it
    ended_at: float | None = None   # when its connection ended

    def send(self, message: tuple) -> bool:
        try:
            with self.send_lock:
                self.conn.send(message)
            return True
        except (OSError, EOFError, ValueError):
            return False


@dataclasses.dataclass
class Event:
    kind: str          # "hello", "outcome" or "ended"
    member: Member
    at: float


class CommitStore:
    """The newest commit of each state key, and who is uploading one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.latest: dict[Any, tuple[wire.CommitId, list[bytearray]]] = {}
        self._uploading: dict[Any, tuple[wire.CommitId, object]] = {}
        self.bytes_received = 0

    def get(self, key: Any) -> tuple[wire.CommitId, list[bytearray]] | None:
        with self._cond:
            return self.latest.get(key)

    def begin_upload(self, key: Any, commit_id: wire.CommitId, owner: object) -> None:
        with self._cond:
            current = self._uploading.get(key)
            if current is None or current[0] < commit_id:
                self._uploading[key] = (commit_id, owner)

    def finish_upload(self, key: Any, commit_id: wire.CommitId, frames: list[bytearray],
                      owner: object) -> wire.CommitId:
        """Store the commit if it is the newest; returns the newest id now held."""
        with self._cond:
            have = self.latest.get(key)
            if have is None or have[0] < commit_id:
                self.latest[key] = (commit_id, frames)
                self.bytes_received += sum(len(f) for f in frames)
            if self._uploading.get(key, (None, None))[1] is owner:
                del self._uploading[key]
            self._cond.notify_all()
            return self.latest[key][0]

    def abandon(self, owner: object) -> None:
        """``owner``'s connection ended: its uploads will not finish."""
        with self._cond:
            for key in [k for k, (_, o) in self._uploading.items() if o is owner]:
                del self._uploading[key]
            self._cond.notify_all()

    def have(self, key: Any, commit_id: wire.CommitId, owner: object) -> str:
        """A failing rank holds ``commit_id``: "ok" once the store has it (or something newer,
        or nobody can deliver it in time), "send" when this rank should upload it."""
        deadline = time.monotonic() + HAVE_WAIT_SECONDS
        with self._cond:
            while True:
                have = self.latest.get(key)
                if have is not None and have[0] >= commit_id:
                    return "ok"
                uploading = self._uploading.get(key)
                if uploading is None or uploading[0] < commit_id:
                    self._uploading[key] = (commit_id, owner)
                    return "send"
                left = deadline - time.monotonic()
                if left <= 0:
                    return "ok"
                self._cond.wait(min(left, 1.0))


class _Discard(queue.Queue):
    """An event queue that keeps nothing."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        pass


class Server:
    """Listens for the workers of every world; see the module docstring."""

    def __init__(self, bind: str, report_events: bool = True) -> None:
        """``report_events=False``: keep no membership news (a server that only keeps
        commits, for a caller that learns of failures elsewhere)."""
        from multiprocessing.connection import Listener
        self.key = secrets.token_bytes(32)
        self.bind = bind
        self._listener = Listener((bind, 0), authkey=self.key, backlog=512)
        self.port = self._listener.address[1]
        self.events: queue.Queue[Event] = queue.Queue() if report_events else _Discard()
        self.store = CommitStore()
        self.members: dict[tuple[int, int], Member] = {}   # (world, rank) -> member
        self._lock = threading.Lock()
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._warm: list = []   # the hosts' warm processes: each lives as long as its connection
        self._accepter = threading.Thread(target=self._accept, name="hvdlite-elastic-accept",
                                          daemon=True)
        self._accepter.start()

    # --- connections -------------------------------------------------------------------------
    def _accept(self) -> None:
        from multiprocessing import AuthenticationError
        while not self._closing:
            try:
                conn = self._listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):
                continue   # a stranger, or a worker killed while connecting
            except OSError:
                return
            if self._closing:
                conn.close()
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name="hvdlite-elastic-worker")
            thread.start()

    def _serve(self, conn) -> None:
        member: Member | None = None
        try:
            while True:
                message = conn.recv()
                kind = message[0]
                if kind == "warm" and member is None:   # a host's warm process (warm_start)
                    with self._lock:
                        self._warm.append(conn)
                    conn.recv()   # it says nothing more: this ends when either side goes
                    raise EOFError("warm process ended")
                if kind == "hello":
                    _, world, rank, size, host, pid = message
                    member = Member(world, rank, size, host, pid, conn)
                    with self._lock:
                        self.members[(world, rank)] = member
                    self.events.put(Event("hello", member, time.monotonic()))
                elif member is None:
                    raise EOFError(f"{kind!r} before hello")
                elif kind == "commit":
                    _, key, commit_id, sizes = message
                    self.store.begin_upload(key, commit_id, conn)
                    frames = wire.recv_frames(conn, sizes)
                    newest = self.store.finish_upload(key, commit_id, frames, conn)
                    member.send(("stored", key, newest))
                elif kind == "fetch":
                    key = message[1]
                    found = self.store.get(key)
                    with member.send_lock:
                        if found is None:
                            conn.send(("nocommit", key))
                        else:
                            wire.send_frames(conn, ("commit", key, found[0]),
                                             [memoryview(f) for f in found[1]])
                elif kind == "session":
                    member.in_session = True
                elif kind == "have":
                    _, key, commit_id = message
                    member.send((self.store.have(key, commit_id, conn), key))
                elif kind == "output":   # a survivor's output after its launcher went
                    _, fd, data = message
                    _write_output(fd, data)
                elif kind == "outcome":
                    member.outcome = tuple(message[1:])
                    self.events.put(Event("outcome", member, time.monotonic()))
                    member.send(("bye",))
                else:
                    raise EOFError(f"unknown message {kind!r}")
        except (EOFError, OSError):
            pass
        except Exception:   # noqa: BLE001 - one broken connection must not stop the driver
            log.exception("hvdlite: elastic driver: a worker's connection failed")
        self.store.abandon(conn)
        try:
            conn.close()
        except OSError:
            pass
        if member is not None:
            member.ended_at = time.monotonic()
            self.events.put(Event("ended", member, member.ended_at))

    # --- the driver's side -------------------------------------------------------------------
    def world_members(self, world: int) -> dict[int, Member]:
        with self._lock:
            return {rank: m for (w, rank), m in self.members.items() if w == world}

    def wait_for_reports(self, world: int, timeout: float) -> bool:
        """Wait (up to ``timeout``) until every worker of ``world`` that runs an
        ``hvd.elastic.run`` function has reported how its world ended, or is gone: a failing
        world's survivors hand in their newest commit first.  Whether they all did."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = [m for m in self.world_members(world).values()
                       if m.in_session and m.outcome is None and m.ended_at is None]
            if not waiting:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def forget(self, world: int) -> None:
        """World ``world`` is over: close its workers' connections (a worker left behind by
        the launcher then ends itself) and forget them."""
        with self._lock:
            gone = [self.members.pop(k) for k in [k for k in self.members if k[0] == world]]
        for member in gone:   # shut the socket down: its reading thread then sees the end
            _shut(member.conn)

    def close(self) -> None:
        self._closing = True
        with self._lock:
            warm, self._warm = self._warm, []
        for conn in warm:   # the warm processes end (once their workers have)
            _shut(conn)
        try:
            from multiprocessing.connection import Client
            host = "127.0.0.1" if self.bind == "0.0.0.0" else self.bind
            Client((host, self.port), authkey=self.key).close()   # wake accept()
        except (OSError, EOFError):
            pass
        self._accepter.join(5)
        self._listener.close()


def _shut(conn) -> None:
    """Shut a connection's socket down, so that the thread reading it sees the end."""
    try:
        sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    except (OSError, ValueError):
        pass
