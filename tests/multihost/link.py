"""A modeled network for the simulated hosts: a token bucket on ``lo``, and the link floor.

The hosts of hosts.py share the machine's network namespace and reach each other over loopback
addresses, so bytes between hosts cost a memory copy.  :class:`LinkCap` caps ``lo`` with a token
bucket (``tc qdisc replace dev lo root tbf rate RATE burst 256kb latency 50ms``) for as long as
it is held, so that those bytes cost what they would on a link of that rate.  Only ``lo`` is
ever shaped; nothing here names an address.

On the bed every loopback byte between hosts is cross-host traffic (ranks of one host reach
each other through shared memory), and all of it, from every host and in both directions,
drains ONE bucket: the modeled network is a single shared link of ``rate`` bytes/s in all.  The
*link floor* of a collective is then the bytes that must cross between hosts divided by that
rate (:func:`allreduce_floor_bytes`, :func:`allgather_floor_bytes`).

While the cap is on, every loopback connection on the machine is capped, other people's tests
included: hold it briefly.  It is removed on leaving the ``with`` block however that happens (an
exception, SIGTERM, SIGINT, SIGHUP), and a guard process removes it if the holder dies without
doing so (SIGKILL, a crash) or holds it longer than ``limit_s``.

Stdlib only: the guard runs this file as a script (``python link.py guard HANDLE LIMIT``).
"""
from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator, Sequence

DEVICE = "lo"          # the only device this module ever shapes
HANDLE = "51:"         # our root qdisc's handle (issue 51), so that we only ever remove our own
BURST = "256kb"
LATENCY = "50ms"
DEFAULT_LIMIT_S = 900.0   # the guard lifts a cap held longer than this
CAUGHT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# tc's rate units (tc(8)): bits per second with SI or IEC prefixes, or bytes per second ("bps").
_PREFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
           "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(|k|m|g|t|ki|mi|gi|ti)(bit|bps)?\s*$", re.I)


class LinkUnavailable(RuntimeError):
    """The link cannot be shaped here (no tc, not root, no tbf in the kernel, or ``lo``
    already has someone else's qdisc); the message says why."""


def parse_rate(text: str) -> float:
    """A rate as tc writes it (``1gbit``, ``10gbit``, ``500mbit``, ``100mbps``, ``1gibit``) in
    bytes per second.  A bare number is bits per second, as for tc."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"rate {text!r}: write it as tc does, e.g. 1gbit, 500mbit, 100mbps")
    number, prefix, unit = match.groups()
    value = float(number) * _PREFIX[prefix.lower()]
    value = value if (unit or "").lower() == "bps" else value / 8
    if value <= 0:
        raise ValueError(f"rate {text!r} must be above zero")
    return value


def format_rate(bytes_per_s: float) -> str:
    """``1 Gbit/s``, ``500 Mbit/s``: a rate in bytes per second, for people."""
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


# --- what crosses the link ---------------------------------------------------------------------
def _check_slots(slots: Sequence[int]) -> None:
    if not slots or min(slots) < 1:
        raise ValueError(f"every host needs a rank: {list(slots)}")


def ring_allreduce_link_bytes(nbytes: int, slots: Sequence[int]) -> float:
    """Bytes between hosts of a flat ring allreduce of ``nbytes`` over every rank, ranks placed
    host after host (``slots``: ranks per host).  Each of the P ranks sends 2(P-1)/P of the
    buffer to its ring successor; the H ring edges that join two hosts carry it across."""
    _check_slots(slots)
    ranks, hosts = sum(slots), len(slots)
    crossing = hosts if hosts > 1 else 0
    return crossing * 2 * (ranks - 1) / ranks * nbytes


def hierarchical_allreduce_link_bytes(nbytes: int, slots: Sequence[int]) -> float:
    """Bytes between hosts of the hierarchical allreduce (reduce within each host, allreduce of
    each piece across hosts between one rank per host, broadcast within each host): every piece
    of the buffer is allreduced once among H ranks, one per host, which moves 2(H-1)/H of it
    out of each of the H hosts (reduce-scatter, then allgather; with H = 2 any algorithm
    does).  In all 2(H-1) * nbytes, whatever the ranks per host."""
    _check_slots(slots)
    return 2 * (len(slots) - 1) * nbytes


def allreduce_floor_bytes(nbytes: int, hosts: int) -> float:
    """The fewest bytes that must cross the shared link for an allreduce of ``nbytes`` across
    ``hosts`` hosts: every element's H host partials must be combined (H-1 transfers) and the
    result reach the other H-1 hosts (H-1 more; loopback TCP has no multicast).  The
    hierarchical allreduce reaches it; a flat ring over L ranks per host moves (HL-1)/(L(H-1))
    times as much (1.5x with 2 + 2)."""
    if hosts < 1:
        raise ValueError("hosts must be at least 1")
    return 2 * (hosts - 1) * nbytes


def allgather_floor_bytes(nbytes_per_rank: int, slots: Sequence[int]) -> float:
    """The fewest bytes that must cross the shared link for an allgather of ``nbytes_per_rank``
    from each rank: every host must receive the rows of the ranks on the other hosts."""
    _check_slots(slots)
    ranks = sum(slots)
    return sum(ranks - local for local in slots) * nbytes_per_rank


def floor_ms(link_bytes: float, bytes_per_s: float) -> float:
    """Milliseconds to move ``link_bytes`` through a link of ``bytes_per_s``."""
    return link_bytes / bytes_per_s * 1e3


def over_floor(ms: float, floor: float) -> str:
    """``ms`` over ``floor`` as ``1.05x``; ``-`` where nothing crosses (a floor of 0)."""
    return f"{ms / floor:.2f}x" if floor > 0 else "-"


# --- tc --------------------------------------------------------------------------------------
def unavailable_reason() -> str | None:
    """Why ``lo`` cannot be shaped on this machine (None when it should be possible)."""
    if not sys.platform.startswith("linux"):
        return "shaping lo needs Linux (tc)"
    if shutil.which("tc") is None:
        return "shaping lo needs tc (iproute2), which is not installed"
    if os.geteuid() != 0:
        return "shaping lo needs root (tc qdisc replace dev lo root tbf ...)"
    return None


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LinkUnavailable(f"tc {' '.join(args)} failed: "
                              f"{(done.stderr or done.stdout).strip()}")
    return done


def root_qdisc() -> tuple[str, str, str]:
    """``lo``'s root qdisc as (kind, handle, tc's whole line): ``("noqueue", "0:", ...)`` when
    nobody has set one."""
    for line in _tc("qdisc", "show", "dev", DEVICE).stdout.splitlines():
        words = line.split()
        if len(words) >= 4 and words[0] == "qdisc" and "root" in words:
            return words[1], words[2], line.strip()
    return "noqueue", "0:", ""


def shaped() -> bool:
    """Whether ``lo`` has a tbf root qdisc (ours or anyone's)."""
    return root_qdisc()[0] == "tbf"


def remove_ours() -> bool:
    """Remove the root qdisc of ``lo`` if it is ours (tbf, handle :data:`HANDLE`); whether
    one was removed.  Safe to call at any time, any number of times."""
    kind, handle, _ = root_qdisc()
    if kind != "tbf" or handle != HANDLE:
        return False
    done = _tc("qdisc", "del", "dev", DEVICE, "root", check=False)
    return done.returncode == 0


class LinkCap:
    """Cap ``lo`` at ``rate`` (tc's notation, e.g. ``1gbit``) while inside ``with``.

    Refuses (:class:`LinkUnavailable`) when tc is missing, when not root, when the kernel has
    no tbf, and when ``lo`` already has a root qdisc other than the kernel's default (someone
    else is shaping it, or a cap was left behind: the message says how to remove it).  Removed
    on leaving, however: an exception, SIGTERM/SIGINT/SIGHUP (handled while inside, in the main
    thread; then the previous handler runs, or SystemExit(128 + signal) is raised where the
    default would have killed the process, so ``finally`` blocks still run), and by a guard
    process when the holder dies without removing it or holds it over ``limit_s`` seconds.
    """

    def __init__(self, rate: str, limit_s: float = DEFAULT_LIMIT_S) -> None:
        self.rate = rate
        self.bytes_per_s = parse_rate(rate)
        self.limit_s = limit_s
        self._guard: subprocess.Popen | None = None
        self._guard_pipe: int | None = None
        self._previous: dict[int, object] = {}
        self._on = False

    def __enter__(self) -> "LinkCap":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Apply the cap (see the class)."""
        reason = unavailable_reason()
        if reason:
            raise LinkUnavailable(reason)
        kind, handle, line = root_qdisc()
        if handle != "0:":
            raise LinkUnavailable(
                f"{DEVICE} already has a root qdisc ({line}): someone else is shaping it, or "
                f"an earlier cap was left behind (then remove it: tc qdisc del dev {DEVICE} "
                f"root); not touching it")
        self._start_guard()
        self._catch_signals()
        try:
            _tc("qdisc", "replace", "dev", DEVICE, "root", "handle", HANDLE, "tbf", "rate",
                self.rate, "burst", BURST, "latency", LATENCY)
            self._on = True
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Remove the cap (if it is still ours), stop the guard, restore the signal handlers.
        Idempotent."""
        self._on = False
        try:
            remove_ours()
        finally:
            self._restore_signals()
            self._stop_guard()

    # A guard in a session of its own (so a kill of the holder's process group spares it)
    # waits on a pipe from the holder; the pipe's end (the holder exited or died) or the time
    # limit makes it remove our cap.
    def _start_guard(self) -> None:
        read_end, write_end = os.pipe()
        try:
            self._guard = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), "guard",
                 str(self.limit_s)], stdin=read_end, stdout=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)
        finally:
            os.close(read_end)
        self._guard_pipe = write_end

    def _stop_guard(self) -> None:
        pipe, self._guard_pipe = self._guard_pipe, None
        if pipe is not None:
            os.close(pipe)
        if self._guard is not None:
            try:
                self._guard.wait(10)
            except subprocess.TimeoutExpired:
                self._guard.kill()
                self._guard.wait()
            self._guard = None

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return   # (only the main thread may set handlers; the guard still covers us)
        for signum in CAUGHT_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _restore_signals(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if previous == signal.SIG_IGN:
            return
        self.stop()   # lift the cap now, whatever the previous handler does next
        if callable(previous):
            previous(signum, frame)
        else:   # the default would kill us: exit instead, so that finally blocks run
            raise SystemExit(128 + signum)


@contextlib.contextmanager
def maybe_capped(rate: str | None,
                 limit_s: float = DEFAULT_LIMIT_S) -> Iterator[LinkCap | None]:
    """``LinkCap(rate)`` when ``rate`` is given, nothing otherwise (``with`` either way)."""
    if rate is None:
        yield None
        return
    with LinkCap(rate, limit_s) as cap:
        yield cap


def _guard(limit_s: float) -> int:
    """The guard's side: wait for the holder's pipe to end or ``limit_s``; remove our cap."""
    for signum in CAUGHT_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)   # (it only ever removes the cap, then exits)
    deadline = time.monotonic() + limit_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if remove_ours():
                print(f"link.py guard: the cap on {DEVICE} was held over {limit_s:g} s; "
                      f"removed it", file=sys.stderr)
            return 0
        ready, _, _ = select.select([0], [], [], min(left, 60.0))
        if ready and not os.read(0, 4096):
            remove_ours()
            return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "guard":
        sys.exit(_guard(float(sys.argv[2])))
    print(f"usage: {sys.argv[0]} guard LIMIT_S (started by LinkCap)", file=sys.stderr)
    sys.exit(2)
