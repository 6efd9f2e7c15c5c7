"""Watching a wait on peers that may never come: a gone rank raises at once, a stall warns, then
gives up at the stall-shutdown time.

Every wait on other ranks outside plain MPI calls goes through :func:`check_wait` about once a
second: the engine's negotiation rounds and data exchanges (a peer's background thread may not
be running at all), and the collectives outside the engine (the process-set registry's
exchanges).  It raises ``RankExitedError`` for a peer the watchdog reported gone (any host) or
a node-local peer whose process vanished (:mod:`liveness`), warns every stall-check period, and
raises ``StallError`` once the wait passes ``HVDLITE_STALL_SHUTDOWN_TIME_SECONDS``.
"""
from __future__ import annotations

import logging
from typing import Iterable

from hvdlite.common.config import Config
from hvdlite.common.errors import RankExitedError, StallError
from hvdlite.common.runtime import liveness

log = logging.getLogger("hvdlite")

_NOT_POSSIBLE = "no further collective operations are possible in this job"


def raise_if_gone(peers: Iterable[int], label: int, what: str, waited: float = 0.0) -> None:
    """``RankExitedError`` if one of ``peers`` (global ranks, ``label`` being this one) is known
    to be gone: reported by the watchdog from any host, or a node-local process that no longer
    runs.  ``what``: the operation waiting for them, for the message."""
    peers = [r for r in peers if r != label]
    departed = liveness.departed_among(peers)
    gone = [] if departed else liveness.vanished(peers)
    if not departed and not gone:   # the usual answer: no message to build
        return
    waiting = (f"while rank {label} waited {waited:.0f} s for it in {what}" if waited
               else f"so rank {label} cannot complete {what}")
    if departed:
        raise RankExitedError(
            f"{'; '.join(departed)}, {waiting}; {_NOT_POSSIBLE}. Look at that rank's output "
            f"and its host's system log for the cause.")
    raise RankExitedError(
        f"rank(s) {gone} on this node exited without shutting down hvdlite (killed, for "
        f"example by the out-of-memory killer, os._exit, or a crash in native code), "
        f"{waiting}; {_NOT_POSSIBLE}. Look at rank(s) {gone}'s output and the system log for "
        f"the cause.")


def check_wait(waited: float, what: str, label: int, peers: Iterable[int], config: Config,
               detail: str) -> None:
    """Called about every second of a wait on ``peers`` that does not end (``waited``
    seconds so far; ``label``: this rank).  Raises if a peer is gone (:func:`raise_if_gone`);
    otherwise warns every stall-check period and raises ``StallError`` once the wait passes
    the stall-shutdown time.  ``detail`` ends both messages (what is pending here, or what
    the user must do)."""
    raise_if_gone(peers, label, what, waited)
    if not config.stall_check_enabled:
        return
    if config.stall_shutdown_seconds > 0 and waited >= config.stall_shutdown_seconds:
        raise StallError(
            f"rank {label} gave up after {waited:.0f} s waiting for the other ranks to "
            f"join {what} (HVDLITE_STALL_SHUTDOWN_TIME_SECONDS="
            f"{config.stall_shutdown_seconds:g}); {detail}")
    if waited >= config.stall_check_seconds and \
            int(waited) % max(1, int(config.stall_check_seconds)) == 0:
        log.warning("rank %d has waited %.0f s for the other ranks to join %s; %s Some rank is "
                    "not responding (stopped, or stuck outside Python).",
                    label, waited, what, detail)
