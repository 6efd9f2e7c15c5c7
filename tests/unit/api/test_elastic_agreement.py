"""``check_host_updates()``'s pipelined broadcast (hvdlite.common.api.host_updates) never
posts an MPI call once the watchdog has reported a rank gone: MPICH's TCP transport retries the
connection to an exited process inside the call, for ever (seen on the simulated hosts: rank 0
hung until the elastic driver gave up on it).  Pure logic, with a communicator that records."""
from __future__ import annotations

import pytest

from hvdlite.common.api.host_updates import HostUpdateAgreement
from hvdlite.common.errors import RankExitedError
from hvdlite.common.runtime import liveness


class RecordingComm:
    def __init__(self) -> None:
        self.posted = 0

    def Ibcast(self, buffer, root):   # noqa: N802 - mpi4py's name
        self.posted += 1
        return DoneRequest()


class DoneRequest:
    def Test(self) -> bool:   # noqa: N802 - mpi4py's name
        return True


def agreement(root: bool) -> HostUpdateAgreement:
    made = HostUpdateAgreement.__new__(HostUpdateAgreement)
    made._comm = RecordingComm()
    made._root = root
    made._request = None
    made._buffer = None
    return made


@pytest.mark.parametrize("root", [True, False])
def test_a_departed_rank_stops_the_check_before_anything_is_posted(monkeypatch, root):
    made = agreement(root)
    monkeypatch.setattr(liveness, "departed_ranks", lambda: [])
    assert made.exchange((1, 2)) is None and made._comm.posted == 1
    assert made.exchange((3, 2)) == ((1, 2) if root else (0, 0)) and made._comm.posted == 2
    monkeypatch.setattr(liveness, "departed_ranks", lambda: [3])
    monkeypatch.setattr(liveness, "departed_among", lambda ranks: ["rank 3 on host b exited"])
    with pytest.raises(RankExitedError, match="rank 3 on host b exited"):
        made.exchange((4, 2))
    assert made._comm.posted == 2   # nothing posted to the world that lost rank 3
