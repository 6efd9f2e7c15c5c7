"""Who exchanges what across hosts in the hierarchical allreduce and allgather (pure logic, no
MPI: unit-tested on its own).

A process set that spans hosts is seen as its hosts, each with its ranks in rank order (local
rank ``i`` of host ``h`` is ``hosts[h][i]``).  Hosts may hold different numbers of ranks.

Allreduce.  On each host the elements are split into one share per local rank
(:func:`share_bounds`: nearly equal, cache-line aligned, the split the intra-node paths use),
and local rank ``i`` holds its host's reduction of share ``i``.  Across hosts, an element must
be combined by the one rank on every host that holds it.  Cutting the buffer at every host's
share boundaries gives *segments*; each segment is held by exactly one rank per host, its
*group*, and is allreduced within that group.  On homogeneous hosts the boundaries coincide, so
segment ``i`` is share ``i`` and its group is local rank ``i`` of every host (Horovod's cross
communicator).  With 3 + 1 ranks the one rank of the small host holds everything, so it takes
part in three groups, one per share of the large host (each carries a third); with 2 + 3 ranks
the shares are cut into halves and thirds, giving the four groups (0, 0), (0, 1), (1, 1),
(1, 2) of local ranks.  Every rank carries its own share across the network, so the traffic
is spread over all ranks of a host, whatever the layout.  A rank in several groups runs their
allreduces in segment order, which every rank shares: the lowest unfinished segment always has
all its members ready, so no order of arrival deadlocks.

Allgather.  Each rank's rows are needed on every host.  Group ``j`` (for ``j`` below the
largest host's rank count) holds local rank ``j mod L`` of every host with ``L`` ranks; in it,
the hosts that have a local rank ``j`` contribute that rank's rows, and every member receives
them into its host's shared result.  On homogeneous hosts group ``j`` is local rank ``j`` of
every host (Horovod's cross communicator again); with 3 + 1 ranks the small host's rank is in
all three groups, contributing only in the first.
"""
from __future__ import annotations

import dataclasses

from hvdlite.common.intranode.shared_window import SharedWindow


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The ranks of a process set by host: ``members[h]`` are host ``h``'s ranks (in the set's
    numbering), ascending; hosts are ordered by their lowest rank."""

    members: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ranks_by_host(cls, per_rank: list[list[int]]) -> "Hosts":
        """From every rank's list of the ranks on its host (what each rank learns from its
        node-local communicator)."""
        unique = {tuple(sorted(ranks)) for ranks in per_rank}
        return cls(tuple(sorted(unique)))

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def local_sizes(self) -> list[int]:
        return [len(m) for m in self.members]

    def locate(self, rank: int) -> tuple[int, int]:
        """(host index, local rank) of ``rank``."""
        for h, ranks in enumerate(self.members):
            if rank in ranks:
                return h, ranks.index(rank)
        raise ValueError(f"rank {rank} is on none of the hosts {self.members}")


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``lo`` .. ``hi`` of the buffer, allreduced across hosts by ``group`` (one rank
    per host, in host order)."""

    lo: int
    hi: int
    group: tuple[int, ...]


def share_bounds(count: int, itemsize: int, local_size: int) -> list[int]:
    """Element boundaries of each local rank's share on a host of ``local_size`` ranks."""
    return SharedWindow.shares(count, itemsize, local_size)


# Below this, a buffer costs its latency, not its bytes, and the hierarchical path leaves it
# to MPI's allreduce over every rank (and its allgather): MPI's small-message algorithms already
# cross hosts only as often as they must when a host's ranks are consecutive, while the
# hierarchical path adds a step within each host before and after the exchange across hosts.
# Measured on the simulated hosts (2 + 2, 3 + 1 and 1 + 2 + 1 ranks), one flat allreduce was
# 2-27% faster than the hierarchical steps at 4-256 KiB, and level at 1 MiB.
SMALL_BYTES = 64 * 1024


def reduce_segments(hosts: Hosts, count: int, itemsize: int) -> list[Segment]:
    """The non-empty segments of a ``count``-element buffer, in element order (see the module's
    docstring); the same on every rank."""
    if count == 0:
        return []
    bounds = [share_bounds(count, itemsize, size) for size in hosts.local_sizes]
    cuts = sorted({b for host in bounds for b in host})
    segments = []
    owner = [0] * hosts.count   # per host: the local rank whose share the cursor is in
    for lo, hi in zip(cuts, cuts[1:]):
        if hi <= lo:
            continue
        group = []
        for h, host in enumerate(bounds):
            while host[owner[h] + 1] <= lo:   # shares can be empty: skip past them
                owner[h] += 1
            group.append(hosts.members[h][owner[h]])
        segments.append(Segment(lo, hi, tuple(group)))
    return segments


def my_segments(segments: list[Segment], rank: int) -> list[Segment]:
    """The segments ``rank`` takes part in, in order (all within its own share)."""
    return [s for s in segments if rank in s.group]


# A segment crosses hosts in pieces, each started as soon as the host has reduced it, so that
# the transfer of one piece overlaps the reduction of the next and the writing out of the one
# before (used where a rank reduces its share chunk by chunk: direct copies).  About this many
# pieces per segment, none under MIN_PIECE_BYTES (each allreduce has its fixed cost).
PIECES_PER_SEGMENT = 8
MIN_PIECE_BYTES = 1 << 20


def cross_pieces(segments: list[Segment], itemsize: int) -> list[Segment]:
    """``segments`` cut into pieces (see :data:`PIECES_PER_SEGMENT`), in order.  The cuts
    depend on the segment alone, so every member of its group cuts it alike and their
    allreduces pair up."""
    cut = []
    for s in segments:
        per = max(MIN_PIECE_BYTES // itemsize, -(-(s.hi - s.lo) // PIECES_PER_SEGMENT), 1)
        cut += [Segment(lo, min(s.hi, lo + per), s.group) for lo in range(s.lo, s.hi, per)]
    return cut


@dataclasses.dataclass(frozen=True)
class GatherGroup:
    """One allgather group: ``group`` (one rank per host, in host order) and, per member,
    whether it contributes its own rows (False: it only receives)."""

    group: tuple[int, ...]
    contributes: tuple[bool, ...]


def gather_groups(hosts: Hosts) -> list[GatherGroup]:
    """The allgather's groups, in the order every rank runs them (see the module's
    docstring)."""
    groups = []
    for j in range(max(hosts.local_sizes)):
        members = tuple(ranks[j % len(ranks)] for ranks in hosts.members)
        groups.append(GatherGroup(members, tuple(len(ranks) > j for ranks in hosts.members)))
    return groups
