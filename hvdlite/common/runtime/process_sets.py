"""Process sets: collective operations on a subset of the ranks (Horovod's ``ProcessSet``).

Every set has its own communicator and its own background engine (negotiation, response cache,
fusion), so operations in two disjoint sets never wait on each other.  Sets are either static
(``hvd.init(process_sets=[...])``) or, when enabled with ``HVDLITE_DYNAMIC_PROCESS_SETS=1`` or
``hvd.init(process_sets="dynamic")``, added and removed at run time.  Adding and removing are
collective over *all* ranks (every rank calls them with the same arguments, in the same order),
as in Horovod.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from hvdlite.common.runtime import state


class ProcessSet:
    """A subset of the job's ranks, identified by ``process_set_id`` once registered.

    ``ProcessSet([0, 2])`` names global ranks; ``ProcessSet(mpi_comm)`` takes the ranks of an
    mpi4py communicator (which must be a sub-communicator of the one hvdlite runs on).  The set
    is usable after ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set(...)``.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | object) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm = None
        self._ranks: list[int] | None = None
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
        else:
            ranks = [int(r) for r in ranks_or_comm]
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"ProcessSet({ranks}) lists a rank more than once.")
            self._ranks = sorted(ranks)

    @property
    def ranks(self) -> list[int]:
        """The global ranks in this set, ascending (resolved at registration for a
        communicator-based set)."""
        if self._ranks is None:
            raise ValueError("this ProcessSet was built from an MPI communicator and is not "
                             "registered yet; pass it to hvd.init(process_sets=[...]) or "
                             "hvd.add_process_set() first.")
        return list(self._ranks)

    def _registered(self) -> int:
        if self.process_set_id is None:
            raise ValueError(f"{self!r} is not registered; pass it to "
                             f"hvd.init(process_sets=[...]) or hvd.add_process_set() first.")
        return self.process_set_id

    def size(self) -> int:
        """Number of ranks in the set."""
        self._registered()
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (its index in ``ranks``)."""
        self._registered()
        me = state.rank()
        if me not in self._ranks:
            raise ValueError(f"rank {me} is not a member of {self!r}.")
        return self._ranks.index(me)

    def included(self) -> bool:
        """True if this process is a member of the set."""
        self._registered()
        return state.rank() in self._ranks

    def __eq__(self, other) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return (self.process_set_id, self._ranks) == (other.process_set_id, other._ranks)

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self._ranks or ())))

    def __repr__(self) -> str:
        ranks = self._ranks if self._ranks is not None else "<from communicator>"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks})"


#: All ranks of the job; the default ``process_set`` of every operation.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def resolve_ranks(process_set: ProcessSet, world) -> list[int]:
    """Global ranks of a set, translating a communicator-based set through ``world``."""
    if process_set.mpi_comm is None:
        return process_set.ranks
    from mpi4py import MPI
    group = process_set.mpi_comm.Get_group()
    translated = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                           world.Get_group())
    if any(r == MPI.UNDEFINED for r in translated):
        raise ValueError("ProcessSet(comm): the communicator contains processes that are not "
                         "part of the communicator hvdlite was initialized with.")
    return sorted(translated)


def check_ranks(ranks: Iterable[int], size: int) -> list[int]:
    ranks = sorted(ranks)
    if not ranks:
        raise ValueError("a process set needs at least one rank.")
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"process set ranks {bad} are out of range for a job of {size} "
                         f"ranks.")
    return ranks
