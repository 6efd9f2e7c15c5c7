"""How the engine talks to the other ranks of its process set: the three exchanges a negotiation
round needs (the engine's only other collective, the agreement before a GPU batch, is an
allgather too), behind a small interface, so that the engine runs over MPI in a job and over an
in-process fake in unit tests (tests/unit/engine/fake_transport.py drives N simulated ranks).

Every method is non-blocking; the caller waits on the returned test function (politely, see
``waiting``), which keeps a dead or stuck peer visible to the stall checks.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

TAG_REQUESTS = 7101
TAG_RESPONSES = 7102


class Transport(Protocol):
    """One process set's negotiation channel; ranks are numbered 0..size-1 within the set."""

    rank: int
    size: int

    def start_and(self, send: np.ndarray, recv: np.ndarray) -> Callable[[], bool]:
        """Start a bitwise AND of ``send`` (uint64 words) across the set into ``recv``;
        return a test that is true once ``recv`` holds the result."""

    def start_allgather(self, mine: np.ndarray, every: np.ndarray) -> Callable[[], bool]:
        """Start gathering every rank's ``mine`` (int64) into ``every``, in rank order."""

    def send_requests(self, payload: Any) -> None:
        """A rank's requests to the coordinator (rank 0); ``payload`` is picklable."""

    def receive_requests(self) -> tuple[int, Any] | None:
        """Coordinator: one rank's requests, ``(rank, payload)``, or None if none arrived."""

    def send_responses(self, rank: int, reply: Any) -> None:
        """Coordinator: the responses for ``rank``."""

    def receive_responses(self) -> Any | None:
        """A rank's responses from the coordinator, or None if they have not arrived."""

    def sends_done(self) -> bool:
        """Whether every message this rank sent has left (its buffers may be reused)."""


class MPITransport:
    """:class:`Transport` over an mpi4py communicator: ``Iallreduce(BAND)``, ``Iallgather``,
    and pickled point-to-point messages (``isend``/``improbe``) under two tags."""

    def __init__(self, comm) -> None:
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._outbox: list = []   # unfinished isend requests

    def start_and(self, send: np.ndarray, recv: np.ndarray) -> Callable[[], bool]:
        return self.comm.Iallreduce(send, recv, op=self._MPI.BAND).Test

    def start_allgather(self, mine: np.ndarray, every: np.ndarray) -> Callable[[], bool]:
        return self.comm.Iallgather(mine, every).Test

    def send_requests(self, payload: Any) -> None:
        self._outbox.append(self.comm.isend(payload, dest=0, tag=TAG_REQUESTS))

    def receive_requests(self) -> tuple[int, Any] | None:
        status = self._MPI.Status()
        msg = self.comm.improbe(source=self._MPI.ANY_SOURCE, tag=TAG_REQUESTS, status=status)
        return None if msg is None else (status.Get_source(), msg.recv())

    def send_responses(self, rank: int, reply: Any) -> None:
        self._outbox.append(self.comm.isend(reply, dest=rank, tag=TAG_RESPONSES))

    def receive_responses(self) -> Any | None:
        msg = self.comm.improbe(source=0, tag=TAG_RESPONSES)
        return None if msg is None else msg.recv()

    def sends_done(self) -> bool:
        if self._outbox and self._MPI.Request.Testall(self._outbox):
            self._outbox.clear()
        return not self._outbox
