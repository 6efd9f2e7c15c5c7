"""``check_host_updates()``'s agreement across ranks: which host update every rank of an
elastic world acts on, at the same commit (see :mod:`hvdlite.common.api.elastic`)."""
from __future__ import annotations

import time

import numpy as np

from hvdlite.common.errors import RankExitedError
from hvdlite.common.runtime import liveness, state as _state


class HostUpdateAgreement:
    """The pipelined broadcast behind ``check_host_updates()``: each check posts rank 0's
    newest host update (a non-blocking ``MPI_Ibcast`` of two integers on a communicator of its
    own, so no negotiation round is spent on it) and takes the one posted at the previous
    check, which the step in between has long completed.  A peer that died is noticed through
    the watchdog while waiting, and nothing is posted once one has (``RankExitedError``)."""

    def __init__(self) -> None:
        process = _state.get("state.check_host_updates()")
        self._raise_if_departed()
        self._comm = process.world.Dup()   # collective: every rank checks at the same point
        self._root = process.rank == 0
        self._buffer = np.zeros(2, dtype=np.int64)
        self._request = None

    def exchange(self, offer: tuple[int, int]) -> tuple[int, int] | None:
        """Take the update posted at the previous check (None at the first) and post
        ``offer`` (rank 0's; the others' is ignored) for the next."""
        agreed = None
        if self._request is not None:
            self._wait()
            agreed = (int(self._buffer[0]), int(self._buffer[1]))
        # Never post to a world that has lost a rank: MPICH (libfabric's TCP) retries the
        # connection to a process that has exited, inside the call, for ever.
        self._raise_if_departed()
        self._buffer = np.array(offer if self._root else (0, 0), dtype=np.int64)
        self._request = self._comm.Ibcast(self._buffer, root=0)
        return agreed

    def drain(self) -> None:
        """Complete the broadcast in flight, if any."""
        if self._request is not None:
            self._wait()

    def _wait(self) -> None:
        pause = 0.0
        while not self._request.Test():
            self._raise_if_departed()
            time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 1e-3)
        self._request = None

    def _raise_if_departed(self) -> None:
        gone = liveness.departed_ranks()
        if gone:
            self._request = None
            described = "; ".join(liveness.departed_among(gone)) or f"rank(s) {gone}"
            raise RankExitedError(f"state.commit(): {described}, so the check for host "
                                  f"updates cannot complete.")
