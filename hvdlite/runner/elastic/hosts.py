"""The elastic driver's hosts: where they come from (a discovery script, or the fixed pool of
``-H``/``--hostfile``), which are blacklisted and for how long, and how a world's ranks are
placed on them.  The rules are horovodrun's (``horovod/runner/elastic/discovery.py``,
``horovod/runner/common/util/hosts.py``):

* the discovery script prints one host per line, ``host:slots`` or ``host`` (then
  ``--slots-per-host`` gives the slots); a script that fails at its first call stops the job,
  later failures keep the last answer;
* hosts keep the order in which they first appeared, so the oldest hosts get the lowest ranks;
  each host's slots are filled before the next host's, up to ``--max-np``;
* a host where a worker failed is blacklisted.  Without ``--blacklist-cooldown-range`` it stays
  so for the rest of the job; with ``LOW HIGH`` (seconds) its ``n``-th blacklisting lasts
  ``LOW * 2**n`` plus a random fraction of ``LOW``, clamped to ``[LOW, HIGH]``, after which it
  counts as added again.
"""
from __future__ import annotations

import random
import subprocess
import time
from typing import Mapping, Sequence

from hvdlite.common.core import HostUpdateResult

COOLDOWN_BOUNDS = (1, 3600)    # horovodrun's limits on --blacklist-cooldown-range, seconds
SCRIPT_TIMEOUT = 60.0          # one run of the discovery script


class DiscoveryError(Exception):
    """The discovery script failed or printed something that is not a host list."""


def parse_discovery_output(text: str, default_slots: int | None) -> dict[str, int]:
    """``host`` / ``host:slots`` lines -> {host: slots} (blank lines ignored; a host listed
    twice keeps its last line; 0 slots means not available)."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        name, sep, slots_text = line.rpartition(":") if ":" in line else (line, "", "")
        if not sep:
            if default_slots is None:
                raise DiscoveryError(f"line {number} ({line!r}) gives no slots: print "
                                     f"'host:slots', or give --slots-per-host")
            slots = default_slots
        else:
            try:
                slots = int(slots_text)
            except ValueError:
                raise DiscoveryError(f"line {number} ({line!r}): {slots_text!r} is not a number "
                                     f"of slots") from None
            if slots < 0:
                raise DiscoveryError(f"line {number} ({line!r}): negative slots")
        if not name or any(c.isspace() for c in name):
            raise DiscoveryError(f"line {number} ({line!r}) is not 'host' or 'host:slots'")
        hosts[name] = slots
    return {name: slots for name, slots in hosts.items() if slots > 0}


class HostDiscoveryScript:
    """Runs ``--host-discovery-script`` (through the shell, as horovodrun does)."""

    def __init__(self, script: str, default_slots: int | None) -> None:
        self.script = script
        self.default_slots = default_slots

    def describe(self) -> str:
        return f"--host-discovery-script {self.script}"

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        try:
            done = subprocess.run(self.script, shell=True, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=SCRIPT_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"{self.script} did not finish within {SCRIPT_TIMEOUT:g} s")
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()[-1:] or ["nothing on stderr"]
            raise DiscoveryError(f"{self.script} exited with status {done.returncode} "
                                 f"({said[0]})")
        try:
            return parse_discovery_output(done.stdout, self.default_slots)
        except DiscoveryError as exc:
            raise DiscoveryError(f"{self.script}: {exc}") from None


class FixedHosts:
    """The pool of ``-H``/``--hostfile``: always the same hosts (failing ones are blacklisted)."""

    def __init__(self, host_slots: Mapping[str, int]) -> None:
        self.host_slots = dict(host_slots)

    def describe(self) -> str:
        return "the hosts of -H/--hostfile"

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self.host_slots)


def check_cooldown_range(low: float, high: float) -> None:
    """ValueError unless ``COOLDOWN_BOUNDS[0] <= low <= high <= COOLDOWN_BOUNDS[1]``."""
    if low < COOLDOWN_BOUNDS[0]:
        raise ValueError(f"--blacklist-cooldown-range: the lower limit {low:g} is below "
                         f"{COOLDOWN_BOUNDS[0]} s")
    if high > COOLDOWN_BOUNDS[1]:
        raise ValueError(f"--blacklist-cooldown-range: the upper limit {high:g} is above "
                         f"{COOLDOWN_BOUNDS[1]} s")
    if low > high:
        raise ValueError(f"--blacklist-cooldown-range {low:g} {high:g}: the lower limit is "
                         f"above the upper one")


class HostState:
    """One host's blacklisting (Horovod's ``HostState``)."""

    def __init__(self, cooldown_range: tuple[float, float] | None) -> None:
        self.blacklisted = False
        self.count = 0
        self.cooldown_range = cooldown_range
        self.cooldown_end = 0.0

    def blacklist(self, now: float, rng: random.Random) -> None:
        self.blacklisted = True
        if self.cooldown_range is None or self.cooldown_end > now:
            return
        low, high = self.cooldown_range
        self.count += 1
        delay = low * (1 << self.count) + rng.uniform(0, 1) * low
        self.cooldown_end = now + max(low, min(high, delay))

    def whitelist(self) -> None:
        self.cooldown_end = 0.0
        self.blacklisted = False

    def resurrected(self, now: float) -> bool:
        """The cooldown of a blacklisted host has run out."""
        return self.blacklisted and 0 < self.cooldown_end <= now


class HostManager:
    """The hosts discovered so far, in assignment order, with their blacklist states."""

    def __init__(self, cooldown_range: tuple[float, float] | None = None,
                 rng: random.Random | None = None) -> None:
        self.cooldown_range = cooldown_range
        self.host_slots: dict[str, int] = {}
        self.order: list[str] = []
        self.states: dict[str, HostState] = {}
        self._rng = rng or random.Random()

    def _state(self, host: str) -> HostState:
        if host not in self.states:
            self.states[host] = HostState(self.cooldown_range)
        return self.states[host]

    def update(self, discovered: Mapping[str, int],
               now: float | None = None) -> HostUpdateResult:
        """Take a new discovery result; what changed (hosts or slots added or removed, or
        blacklisted hosts back after their cooldown)."""
        now = time.monotonic() if now is None else now
        result = HostUpdateResult.no_update
        for host in self.host_slots:
            if host not in discovered:
                result |= HostUpdateResult.removed
        for host, slots in discovered.items():
            before = self.host_slots.get(host)
            if before is None or slots > before:
                result |= HostUpdateResult.added
            elif slots < before:
                result |= HostUpdateResult.removed
            if self._state(host).resurrected(now):
                self._state(host).whitelist()
                result |= HostUpdateResult.added
        self.host_slots = dict(discovered)
        self.order = [h for h in self.order if h in discovered] + [
            h for h in discovered if h not in self.order]
        return result

    def blacklist(self, host: str, now: float | None = None) -> None:
        self._state(host).blacklist(time.monotonic() if now is None else now, self._rng)

    def is_blacklisted(self, host: str) -> bool:
        return host in self.states and self.states[host].blacklisted

    def available(self) -> list[tuple[str, int]]:
        """(host, slots) of every discovered host that is not blacklisted, oldest first."""
        return [(h, self.host_slots[h]) for h in self.order if not self.is_blacklisted(h)]

    def describe(self, now: float | None = None) -> str:
        """What is known of the hosts, for messages."""
        now = time.monotonic() if now is None else now
        usable = ", ".join(f"{h}:{s}" for h, s in self.available()) or "none"
        parts = [f"available: {usable}"]
        black = []
        for host in self.order:
            state = self.states.get(host)
            if state is not None and state.blacklisted:
                if state.cooldown_end > now:
                    black.append(f"{host} (for {state.cooldown_end - now:.0f} s more)")
                else:
                    black.append(f"{host} (for the rest of the job)")
        if black:
            parts.append(f"blacklisted after failures: {', '.join(black)}")
        return "; ".join(parts)


def assign(available: Sequence[tuple[str, int]], max_np: int | None) -> list[tuple[str, int]]:
    """Fill the hosts' slots in order, up to ``max_np`` ranks: [(host, ranks on it)]."""
    placed, total = [], 0
    for host, slots in available:
        take = slots if max_np is None else min(slots, max_np - total)
        if take <= 0:
            break
        placed.append((host, take))
        total += take
    return placed


def desired_placement(available: Sequence[tuple[str, int]], min_np: int,
                      max_np: int | None) -> list[tuple[str, int]]:
    """Where the ranks would go on the hosts ``available`` now (:func:`assign`), or ``[]``
    when they offer fewer than ``min_np`` slots: what a running world is compared with."""
    if sum(slots for _, slots in available) < min_np:
        return []
    return assign(available, max_np)
