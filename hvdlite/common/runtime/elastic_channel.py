"""A worker's connection to the elastic driver (``hvdlite run --min-np/--max-np/...``).

The driver starts every world with :data:`~elastic_wire.DRIVER_VARIABLE` and the job's key in
the workers' environment; ``hvd.init()`` then connects each rank to it (:func:`connect`) and
says hello (world, rank, size, host, pid), so the driver knows who runs where and notices a
rank whose connection ends without a word.  Over the connection:

* rank 0 ships each commit (on a background thread: :class:`Shipper`), and the driver answers
  ``stored``; the next world's rank 0 fetches the latest one;
* the driver tells rank 0 when hosts were added or removed (``hosts_updated``);
* when the world ends, every rank says how (``done``, ``reset``, ``interrupt``, ``error``), and
  a rank whose world failed first offers its latest commit in case the driver lacks it.

One thread per process reads the driver's messages; sends are serialized by a lock (a commit
being shipped delays a short message by at most that transfer).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable

from hvdlite.common.runtime import elastic_wire as wire, output_relay, warm_start

log = logging.getLogger("hvdlite")

CONNECT_SECONDS = 30.0   # the driver is up before any worker starts; this covers a slow network
REPLY_SECONDS = 60.0     # a request the driver does not answer in time is given up
ORPHAN_SECONDS = 60.0    # a worker whose shield is gone ends itself after this at the latest
SHIP_INTERVAL = 0.5      # seconds between two commits shipped in the background, at least
SHIP_DUTY = 0.05         # and at most this share of the time spent shipping

Listener = Callable[[int, int], None]   # (timestamp, HostUpdateResult) -> None


class DriverGone(ConnectionError):
    """The connection to the elastic driver ended."""


class Channel:
    """One rank's connection to the driver of world ``world``."""

    def __init__(self, address: tuple[str, int], key: bytes, world: int) -> None:
        self.address = address
        self.key = key
        self.world = world
        self.rank = -1
        self._conn = None
        self._send_lock = threading.Lock()
        self._request_lock = threading.Lock()
        self._replies: queue.Queue = queue.Queue()
        self._stored_cond = threading.Condition()
        self._stored: dict[Any, wire.CommitId] = {}   # key -> newest commit the driver holds
        self._listeners: list[Listener] = []
        self._unheard: list[tuple[int, int]] = []   # updates that came before any listener
        self._listeners_lock = threading.Lock()
        self.closed = False
        self.orphaned = False   # the shield that the launcher started for us is gone

    # --- setting up ---------------------------------------------------------------------------
    def connect(self, rank: int, size: int, host: str) -> None:
        """Connect and say hello; raises OSError (or AuthenticationError) when it cannot."""
        from multiprocessing.connection import Client
        deadline = time.monotonic() + CONNECT_SECONDS
        while True:
            try:
                self._conn = Client(self.address, authkey=self.key)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.rank = rank
        self._send(("hello", self.world, rank, size, host, os.getpid()))
        warm_start.report_modules()   # what the script imported: the warm process starts on it
        threading.Thread(target=self._read, name="hvdlite-elastic", daemon=True).start()
        shield = os.environ.get(wire.SHIELD_VARIABLE)
        if shield and shield.isdigit():
            threading.Thread(target=self._watch_shield, args=(int(shield),), daemon=True,
                             name="hvdlite-elastic-shield").start()

    def _watch_shield(self, shield: int) -> None:
        """When the MPI launcher has killed the shield (another rank failed), this worker is
        left to report to the driver (``hvd.elastic.run`` does, then exits); it ends itself as
        soon as the driver closes the connection, or after :data:`ORPHAN_SECONDS`."""
        _wait_until_gone(shield)
        self.orphaned = True
        if self.closed:
            _exit_now()
        time.sleep(ORPHAN_SECONDS)
        log.warning("hvdlite: elastic: the launcher stopped this worker's world %g s ago; "
                    "exiting.", ORPHAN_SECONDS)
        _exit_now()

    # --- sending ------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        if self.closed:
            raise DriverGone("the connection to the elastic driver is closed")
        with self._send_lock:
            self._conn.send(message)

    def send_commit(self, key: Any, commit_id: wire.CommitId, packed: wire.Packed) -> None:
        """Ship a packed commit (blocking for the transfer; the driver answers ``stored``)."""
        frames = packed.frames()
        if self.closed:
            raise DriverGone("the connection to the elastic driver is closed")
        with self._send_lock:
            wire.send_frames(self._conn, ("commit", key, commit_id), frames)

    def request(self, message: tuple, timeout: float = REPLY_SECONDS) -> tuple:
        """Send ``message`` and return the driver's reply to it (one request at a time)."""
        with self._request_lock:
            self._send(message)
            try:
                reply = self._replies.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"the elastic driver did not answer {message[0]!r} within "
                                   f"{timeout:g} s") from None
            if reply is None:
                raise DriverGone("the connection to the elastic driver ended")
            return reply

    def tell(self, message: tuple) -> None:
        """Send ``message`` without waiting for anything."""
        self._send(message)

    # --- the driver's side --------------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(timestamp, result)`` for every host update, including those that
        came before it was added (the driver may tell rank 0 before training starts)."""
        with self._listeners_lock:
            self._listeners.append(listener)
            unheard = list(self._unheard)
        for update in unheard:
            listener(*update)

    def _hosts_updated(self, timestamp: int, result: int) -> None:
        with self._listeners_lock:
            self._unheard.append((timestamp, result))
            listeners = list(self._listeners)
        for listener in listeners:
            listener(timestamp, result)

    def stored(self, key: Any) -> wire.CommitId | None:
        with self._stored_cond:
            return self._stored.get(key)

    def wait_stored(self, key: Any, commit_id: wire.CommitId, timeout: float) -> bool:
        """Wait until the driver holds ``commit_id`` of ``key`` (or a newer one)."""
        deadline = time.monotonic() + timeout
        with self._stored_cond:
            while not self.closed:
                have = self._stored.get(key)
                if have is not None and have >= commit_id:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._stored_cond.wait(left)
        return False

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "hosts_updated":
                    self._hosts_updated(message[1], message[2])
                elif kind == "stored":
                    with self._stored_cond:
                        _, key, commit_id = message
                        if self._stored.get(key) is None or self._stored[key] < commit_id:
                            self._stored[key] = commit_id
                        self._stored_cond.notify_all()
                elif kind == "commit":
                    _, key, commit_id, sizes = message
                    self._replies.put(("commit", key, commit_id, wire.recv_frames(self._conn,
                                                                                  sizes)))
                else:
                    self._replies.put(message)
        except (EOFError, OSError):
            pass
        except Exception:   # noqa: BLE001 - a broken message must not go unnoticed
            log.exception("hvdlite: reading from the elastic driver failed")
        self.closed = True
        self._replies.put(None)
        with self._stored_cond:
            self._stored_cond.notify_all()
        if self.orphaned:   # the launcher took our shield, and the driver is done with us
            _exit_now()

    def forget_in_child(self) -> None:
        """In a forked child: drop this process's copy of the socket without a word (a child
        holding it would hide the parent's end from the driver)."""
        handle = getattr(self._conn, "_handle", None)
        if handle is not None:
            self._conn._handle = None   # never closed again by the Connection (fd reuse)
            try:
                os.close(handle)
            except OSError:
                pass
        self.closed = True


class Shipper:
    """Ships rank 0's commits to the driver on a background thread, newest only: a commit made
    while the previous one is still on the wire replaces any that waits.

    With more than one rank the driver's copy is a safety net (a rank whose world fails sends
    its own newest commit first, see ``hvd.elastic.run``), so shipping is paced to keep the
    thread busy at most :data:`SHIP_DUTY` of the time (at least :data:`SHIP_INTERVAL` apart):
    on a machine whose cores all train, a commit per step would otherwise slow every step.
    Only a world that loses every rank at once then resumes from an older commit.  A world of
    one rank ships every commit (newest only); :meth:`flush` sends the newest at once."""

    def __init__(self, channel: Channel, paced: bool) -> None:
        self._channel = channel
        self._paced = paced
        self._cond = threading.Condition()
        self._waiting: tuple | None = None   # (key, commit_id, committed)
        self._busy = False
        self._hurry = False
        self._not_before = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hvdlite-elastic-ship",
                                         daemon=True)
        self._thread.start()

    def offer(self, key: Any, commit_id: wire.CommitId, committed: Any) -> None:
        """Ship ``committed`` (a state's committed tree, packed on the shipping thread)."""
        with self._cond:
            idle = self._waiting is None and not self._busy
            self._waiting = (key, commit_id, committed)
            # A thread that waits for its pace wakes up by itself: waking it for every commit
            # would cost the training thread a switch of the interpreter lock each time.
            if idle and time.monotonic() >= self._not_before:
                self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Send what waits now and wait until nothing waits or is on the wire (True), or
        ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._hurry = True
            self._cond.notify_all()
            while self._waiting is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._channel.closed:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None or (
                        not self._hurry and time.monotonic() < self._not_before):
                    if self._waiting is None:
                        self._cond.wait()
                    else:
                        self._cond.wait(max(self._not_before - time.monotonic(), 0.001))
                key, commit_id, committed = self._waiting
                self._waiting, self._busy = None, True
            started = time.monotonic()
            try:
                self._channel.send_commit(key, commit_id, wire.pack(committed))
            except (OSError, DriverGone) as exc:
                self.error = exc
            except Exception as exc:   # noqa: BLE001 - e.g. a codec that cannot export
                self.error = exc
                log.exception("hvdlite: shipping a commit to the elastic driver failed")
            took = time.monotonic() - started
            del committed   # (a snapshot the training thread may want to reuse)
            with self._cond:
                self._busy = False
                if self._paced:
                    self._not_before = time.monotonic() + max(SHIP_INTERVAL,
                                                              took / SHIP_DUTY - took)
                self._cond.notify_all()


def _exit_now() -> None:
    import sys
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001 - exiting regardless
            pass
    output_relay.drain()
    os._exit(wire.EXIT_RESET)


# --- this process's channel ------------------------------------------------------------------
_channel: Channel | None = None


def current() -> Channel | None:
    """This process's channel to the driver (None when no elastic driver started it)."""
    return _channel


def install(channel) -> None:
    """Make ``channel`` this process's channel: one with :class:`Channel`'s requests that is no
    driver's connection (torchrun's store, :mod:`~hvdlite.common.runtime.store_commits`)."""
    global _channel
    _channel = channel


def driven() -> bool:
    """Whether an elastic driver started this process."""
    return _channel is not None or bool(os.environ.get(wire.DRIVER_VARIABLE))


def connect(rank: int, size: int, host: str) -> str | None:
    """At ``init()``: connect to the driver named in the environment, once per process.  None
    when connected (or not driven at all), else what went wrong (init raises it on every
    rank).  The key leaves the environment, so the script's own children never see it."""
    global _channel
    if _channel is not None or not os.environ.get(wire.DRIVER_VARIABLE):
        return None
    address = os.environ[wire.DRIVER_VARIABLE]
    try:
        host_part, _, port = address.rpartition(":")
        key = bytes.fromhex(os.environ.pop(wire.KEY_VARIABLE))
        world = int(os.environ.get(wire.WORLD_VARIABLE, "0"))
        channel = Channel((host_part, int(port)), key, world)
    except (KeyError, ValueError) as exc:
        return (f"{wire.DRIVER_VARIABLE}={address!r} needs {wire.KEY_VARIABLE} and "
                f"{wire.WORLD_VARIABLE} from hvdlite run's elastic driver ({exc})")
    try:
        channel.connect(rank, size, host)
    except Exception as exc:   # noqa: BLE001 - OSError, AuthenticationError, EOFError
        return f"cannot reach the elastic driver at {address} from host {host}: {exc}"
    _channel = channel
    return None


def _after_fork_in_child() -> None:
    global _channel
    if _channel is not None:
        _channel.forget_in_child()
        _channel = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait_until_gone(shield: int) -> None:
    """Return when process ``shield`` has ended: this worker's parent (a cold start), or, for
    a worker forked by the host's warm process (``warm_start``), a process it can only watch."""
    if os.getppid() != shield:
        warm_start.wait_for_exit(shield)
        return
    while os.getppid() == shield:
        time.sleep(0.2)
