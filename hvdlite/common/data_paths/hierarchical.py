"""Hierarchical allreduce and allgather for process sets whose ranks span hosts
(``HVDLITE_HIERARCHICAL_ALLREDUCE`` / ``HVDLITE_HIERARCHICAL_ALLGATHER``).

Allreduce, as Horovod's hierarchical allreduce does it (reduce-scatter within the host,
allreduce of one's share across hosts, allgather within the host):

(A batch under 64 KiB, :data:`~.hier_plan.SMALL_BYTES`, is left to MPI's allreduce over every
rank: it costs its latency, and one flat allreduce measured faster than these three steps.)

1. within each host, local rank ``i`` reduces share ``i`` of the elements over its host's ranks
   (a single large tensor by direct copies between the ranks' memory where the host allows
   them, else through the host's shared-memory window where it takes the batch, else an MPI
   ``Reduce_scatter`` on the host's communicator; a host with one rank holds everything);
2. across hosts, each rank allreduces its share with the ranks that hold the same elements on
   the other hosts (:mod:`.hier_plan`: on homogeneous hosts, the ranks of equal local rank;
   hosts with different rank counts are handled too), in pieces of about an eighth of a share;
   where the host reduces by direct copies, each piece crosses as soon as it is reduced and is
   gathered as soon as it is back, so the transfer overlaps both steps within the host;
3. within each host, every rank gathers the other shares (written into its memory by their
   owners, read straight out of the window, or an MPI ``Allgatherv``) and applies the
   postscale.

Each element crosses the network once per host instead of once per rank, and the intra-host
traffic stays in memory.  Every rank of a host receives the same bits (each element is reduced
by one rank per host, then by one MPI allreduce across hosts).

Allgather, as Horovod's MPI hierarchical allgather: every rank copies its rows into its host's
shared result buffer, the hosts exchange rows (each rank carrying its own, see
:mod:`.hier_plan`), and every rank copies the whole result out.

What runs where is decided from the batch and from values every rank shares (the hosts, found
collectively on first use; the host's window decides collectively on that host), so all ranks
make the same collective calls in the same order.  Which intra-host mechanism a host uses never
changes what crosses the network, so hosts may differ there (one host's ``/dev/shm`` full).
"""
from __future__ import annotations

import logging

import numpy as np

from hvdlite.common.data_paths.hier_plan import (SMALL_BYTES, Hosts, gather_groups, my_segments,
                                               cross_pieces, reduce_segments, share_bounds)
from hvdlite.common.data_paths.helpers import (POLITE_MAX_BYTES, copy_out_pieces, displacements,
                                              flat, pack, phase, postscale_factor, row_layout)
from hvdlite.common.dtypes import (dtype_info, mpi_datatype, mpi_reduce_op, numpy_reduce_ufunc,
                                   scale_in_place, scale_into)
from hvdlite.common.engine.data_path import Batch, DataPath, PathContext
from hvdlite.common.engine.fusion import FusionBuffer
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import ALLGATHER, ALLREDUCE, Response
from hvdlite.common.errors import HvdliteError
from hvdlite.common.intranode.direct_copies import MIN_BYTES as COPIES_MIN_BYTES
from hvdlite.common.intranode.direct_copies import DirectCopies, DirectCopyError
from hvdlite.common.intranode.node_buffer import NodeBuffer
from hvdlite.common.intranode.shared_window import SharedWindow
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime.waiting import PEER_SPIN_SECONDS, wait_until

log = logging.getLogger("hvdlite")


class HierarchicalPath(DataPath):
    """Host allreduces and allgathers of a set spanning hosts (see the module's docstring).

    ``allreduce_on`` / ``allgather_on`` start as the knobs say (rank 0's values); a benchmark
    may flip them, on every rank at a point every rank reaches alike with nothing in flight.
    Counters for tests and benchmarks: ``allreduces`` and ``allgathers`` (batches run here),
    ``by_copies``, ``by_window`` and ``by_mpi`` (allreduces whose intra-host steps went by
    direct copies, through this host's shared-memory window or through MPI; none when the host
    has one rank).
    """

    name = "hierarchical"

    def __init__(self, context: PathContext) -> None:
        super().__init__(context)
        from mpi4py import MPI
        self._MPI = MPI
        config = context.config
        self.allreduce_on = config.hierarchical_allreduce
        self.allgather_on = config.hierarchical_allgather
        self._window_bytes = config.shm_window_bytes
        self._cma = config.direct_copies
        self._max_sleep = context.max_sleep
        self._on_slow = context.on_slow
        self.hosts: Hosts | None = None     # found on first use (None: one host, or not yet)
        self._decided = False
        self.local = None                   # this host's ranks of the set
        self.local_size = 1
        self.direct: DirectCopies | None = None  # single tensors by direct copies
        self._copies_somewhere = False      # some host's ranks use direct copies (agreed)
        self.window: SharedWindow | None = None     # allreduce's intra-host window
        self.node_buffer: NodeBuffer | None = None  # allgather's result, one per host
        self._gather_slot = 0               # slot size every host's node buffer has (agreed)
        self._gather_refused = None         # smallest allgather the hosts had no room for
        self._groups: dict[tuple[int, ...], object] = {}   # cross-host groups (None: not in)
        self._fusion = FusionBuffer()
        self._share = FusionBuffer()
        self.allreduces = 0
        self.allgathers = 0
        self.by_copies = 0
        self.by_window = 0
        self.by_mpi = 0

    # --- choosing -----------------------------------------------------------------------------
    def enabled(self, batch: Batch) -> bool:
        if self._decided and self.hosts is None:   # the set lies on one host: never
            return False
        response = batch[0][0]
        if response.device >= 0 or self.size < 2:
            return False
        if response.kind == ALLREDUCE:
            if not self.allreduce_on or response.reduce_op == ReduceOp.Adasum:
                return False
            if sum(entry.nbytes for _, entry in batch) < SMALL_BYTES:   # latency-bound
                return False
        elif response.kind != ALLGATHER or not self.allgather_on:
            return False
        if not self._spans_hosts():   # collective on first use
            return False
        if response.kind == ALLGATHER:   # (a fused batch of small ones: one flat Allgatherv)
            return len(batch) == 1 and self._gather_room(response)
        return True

    def _spans_hosts(self) -> bool:
        """Whether the set's ranks span hosts, at least one of which holds several of them
        (with one rank per host there is nothing to do within a host).  Collective over the
        set on the first call."""
        if not self._decided:
            self._decided = True
            MPI = self._MPI
            local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            hosts = Hosts.from_ranks_by_host(self.comm.allgather(local.allgather(self.rank)))
            if hosts.count < 2 or max(hosts.local_sizes) < 2:
                local.Free()
                return False
            self.hosts, self.local, self.local_size = hosts, local, local.Get_size()
            if self.local_size > 1 and self._window_bytes > 0:
                self.window = SharedWindow(local, self._window_bytes, self._max_sleep,
                                           self._on_slow)
                self.node_buffer = NodeBuffer(local, self._window_bytes, self._max_sleep,
                                              self._on_slow)
            if self.local_size > 1 and self._cma != "off":
                # Decided now, on every host at once (the probe is collective on the host), so
                # that every rank knows whether a large tensor's outcome must be agreed on.
                names = [self.context.global_ranks[r] for r in hosts.members[
                    hosts.locate(self.rank)[0]]]
                self.direct = DirectCopies(local, self._max_sleep, self._on_slow,
                                              required=self._cma == "on", global_ranks=names)
                self.direct.usable(COPIES_MIN_BYTES)   # the probe
            self._copies_somewhere = bool(self.comm.allreduce(self._copies_here, op=MPI.LOR))
        return self.hosts is not None

    @property
    def _copies_here(self) -> bool:
        return self.direct is not None and self.direct.available

    def _gather_room(self, response: Response) -> bool:
        """Whether every host's shared buffer holds this allgather's result, growing them if
        every host has room (collective over the set when they must grow)."""
        if self._window_bytes <= 0:   # no shared memory asked for: MPI's own allgather
            return False
        _, row = row_layout(response.shape)
        nbytes = sum(response.first_dims) * row * dtype_info(response.dtype).itemsize
        if nbytes < SMALL_BYTES:   # latency-bound: one MPI allgather beats two barriers more
            return False
        if nbytes <= self._gather_slot:
            return True
        if nbytes > self._window_bytes or (self._gather_refused is not None
                                           and nbytes >= self._gather_refused):
            return False
        room = self.node_buffer.room_for(nbytes) if self.node_buffer is not None else True
        if not self.comm.allreduce(room, op=self._MPI.LAND):
            self._gather_refused = nbytes
            if self.rank == 0:   # (set rank 0)
                log.warning("hvdlite: some host's /dev/shm has too little free space for the "
                            "hierarchical allgather of %d bytes; it goes through MPI's "
                            "allgather instead.", nbytes)
            return False
        if self.node_buffer is not None:
            self.node_buffer.grow(nbytes)
        self._gather_slot = NodeBuffer.slot_size(nbytes, self._window_bytes)
        return True

    def _group(self, members: tuple[int, ...]):
        """The communicator of a cross-host group (None if this rank is not in it), made on
        first need by every rank of the set (each computes the same groups in the same
        order)."""
        if members not in self._groups:
            inside = self.rank in members
            comm = self.comm.Split(0 if inside else self._MPI.UNDEFINED,
                                   key=members.index(self.rank) if inside else 0)
            self._groups[members] = comm if inside else None
        return self._groups[members]

    # --- running ------------------------------------------------------------------------------
    def execute(self, batch: Batch) -> None:
        response, entry = batch[0]
        if response.kind == ALLGATHER:
            self._allgather(response, entry)
            self.allgathers += 1
        else:
            self._allreduce(batch)
            self.allreduces += 1

    def _wait(self, request) -> None:
        wait_until(request.Test, self._max_sleep, on_slow=self._on_slow,
                   spin_seconds=PEER_SPIN_SECONDS)

    def _finish(self, requests, polite: bool) -> None:
        """Wait for collectives (a request or a list): politely (small), or inside MPI
        (large: see MPIPath)."""
        if not isinstance(requests, list):
            requests = [requests]
        if not requests:
            return
        if polite:
            MPI = self._MPI
            self._wait(requests[0] if len(requests) == 1 else
                       _AllOf(requests, MPI.Request.Testall))
        else:
            self._MPI.Request.Waitall(requests)

    def _allreduce(self, batch: Batch) -> None:
        response, entry = batch[0]
        info = dtype_info(response.dtype)
        op = ReduceOp(response.reduce_op)
        mpi_type, mpi_op = mpi_datatype(info), mpi_reduce_op(info, op)
        sizes = [e.array.size for _, e in batch]
        count = sum(sizes)
        if count == 0:
            return
        segments = reduce_segments(self.hosts, count, info.itemsize)
        for segment in segments:   # (first time: every rank makes the group together)
            self._group(segment.group)
        # (every path cuts its segments alike, whatever it does within its host, so that the
        # allreduces of each group pair up)
        cut = cross_pieces(my_segments(segments, self.rank), info.itemsize)
        nbytes = count * info.itemsize
        polite = nbytes <= POLITE_MAX_BYTES

        def across(lo: int, share: np.ndarray) -> None:
            """This host's reduction of elements lo.. -> every host's: one allreduce per
            piece, all in flight at once (a rank in several groups would otherwise carry
            its segments one after another)."""
            crossing = MpiCrossing(self, batch, cut, mpi_type, mpi_op, polite)
            for i, (a, b) in enumerate(crossing.pieces):
                crossing.start(i, share[a - lo:b - lo])
            self._finish(crossing.requests, polite)

        def within(src: np.ndarray, out: np.ndarray) -> None:
            """MPI on the host's communicator: src reduced, across, gathered into out."""
            self._by_mpi(batch, src, out, count, info, mpi_type, mpi_op, across, polite)

        post = postscale_factor(response, self.size)
        ufunc = numpy_reduce_ufunc(info, op)
        if len(batch) == 1:
            src = flat(entry.array)   # in place: the very same view (`out is src` below)
            out = src if entry.output is entry.array else flat(entry.output)
            prescale = 1.0 if entry.stand_in else response.prescale
            if self._copies_somewhere and nbytes >= COPIES_MIN_BYTES:
                crossing = MpiCrossing(self, batch, cut, mpi_type, mpi_op, polite)
                self._single_by_copies(batch, src, out, ufunc, prescale, post, across, within,
                                       crossing)
            else:
                self._single(batch, src, out, ufunc, prescale, post, across, within)
            return
        outputs = [flat(e.output) for _, e in batch]
        if self.local_size > 1 and self.window is not None and self.window.usable(nbytes):
            pack(batch, self.window.pack_buffer(count, info.np_dtype), sizes, response.prescale)
            phase(batch, "SHARED_WINDOW_REDUCESCATTER")
            pieces = self.window.reduce(count, info.np_dtype, ufunc, between=across)
            self.by_window += 1
        else:
            buf = self._fusion.view(nbytes, info.np_dtype)
            pack(batch, buf, sizes, response.prescale)
            if self.local_size == 1:
                across(0, buf)
            else:
                within(buf, buf)
            pieces = [(0, count, buf)]
        phase(batch, "MEMCPY_OUT_FUSION_BUFFER")
        copy_out_pieces(outputs, sizes, pieces, post)

    def _single(self, batch: Batch, src: np.ndarray, out: np.ndarray, ufunc, prescale: float,
                post: float, across, within) -> None:
        """One tensor, reduced within the host through the window or MPI (or not at all)."""
        if self.local_size == 1:   # this host's reduction is the input itself
            scale_into(out, src, prescale)
            across(0, out)
            scale_in_place(out, post)
        elif self.window is not None and self.window.usable(src.nbytes, single=True):
            phase(batch, "SHARED_WINDOW_REDUCESCATTER")
            self.window.allreduce_one(src, out, ufunc, prescale, post, between=across)
            self.by_window += 1
        else:
            if prescale != 1.0 or out is src:
                scale_into(out, src, prescale)
                src = out
            within(src, out)
            scale_in_place(out, post)

    def _single_by_copies(self, batch: Batch, src: np.ndarray, out: np.ndarray, ufunc,
                          prescale: float, post: float, across, within,
                          crossing: "MpiCrossing") -> None:
        """A large tensor where some host reduces it by direct copies: those hosts do, the
        others as usual; then every rank of the set learns whether a copy failed anywhere (a
        failed copy leaves that host's share incomplete, which the other hosts received too),
        so that no rank returns a wrong result silently."""
        response = batch[0][0]
        failure: DirectCopyError | None = None
        if self._copies_here:
            phase(batch, "DIRECT_COPIES_REDUCESCATTER")
            try:
                self.direct.allreduce_one(src, out, ufunc, prescale, post, name=response.name,
                                          crossing=crossing)
                self.by_copies += 1
            except DirectCopyError as exc:
                failure = exc
        else:
            self._single(batch, src, out, ufunc, prescale, post, across, within)
        me = self.context.global_ranks[self.rank]
        mine = np.array([failure is not None and me in failure.ranks], dtype=np.int32)
        every = np.empty(self.size, dtype=np.int32)
        self._wait(self.comm.Iallgather([mine, self._MPI.INT32_T],
                                        [every, self._MPI.INT32_T]))
        if failure is not None:
            raise failure
        failed = np.flatnonzero(every).tolist()
        if failed:
            ranks = [self.context.global_ranks[i] for i in failed]
            raise HvdliteError(
                f"The allreduce of {response.name!r} failed: a direct copy between ranks' memory "
                f"failed on rank(s) {ranks}, on another host, so its result is incomplete on "
                f"every rank. Look at those ranks' errors; HVDLITE_DIRECT_COPIES=0 avoids direct "
                f"copies.")

    def _by_mpi(self, batch: Batch, src: np.ndarray, out: np.ndarray, count: int, info,
                mpi_type, mpi_op, across, polite: bool) -> None:
        """The intra-host steps through MPI on the host's communicator: ``Reduce_scatter`` of
        ``src`` into this rank's share, ``across`` it, ``Allgatherv`` into ``out``."""
        bounds = share_bounds(count, info.itemsize, self.local_size)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        me = self.local.Get_rank()
        share = self._share.view(counts[me] * info.itemsize, info.np_dtype)
        phase(batch, "MPI_REDUCESCATTER")
        if polite:
            self._wait(self.local.Ireduce_scatter([src, mpi_type], [share, mpi_type], counts,
                                                  op=mpi_op))
        else:
            self.local.Reduce_scatter([src, mpi_type], [share, mpi_type], counts, op=mpi_op)
        across(bounds[me], share)
        phase(batch, "MPI_ALLGATHER")
        request = self.local.Iallgatherv([share, mpi_type], [out, (counts, bounds[:-1]),
                                                             mpi_type])
        self._finish(request, polite)
        self.by_mpi += 1

    def _allgather(self, response: Response, entry: Entry) -> None:
        info = dtype_info(response.dtype)
        mpi_type = mpi_datatype(info)
        row_shape, row = row_layout(response.shape)
        entry.output = entry.allocate((sum(response.first_dims),) + row_shape, info.np_dtype)
        out = entry.output.reshape(-1)
        counts = [d * row for d in response.first_dims]
        displs = displacements(counts)
        total = sum(counts)
        groups = gather_groups(self.hosts)
        for g in groups:   # (first time: every rank makes the group together)
            self._group(g.group)
        result = out if self.local_size == 1 else self.node_buffer.next_slot(total,
                                                                            info.np_dtype)
        me = self.rank
        np.copyto(result[displs[me]:displs[me] + counts[me]], entry.array.reshape(-1))
        if self.local_size > 1:
            self.node_buffer.barrier()
        requests = []   # every group this rank is in, all in flight at once
        for g in groups:
            comm = self._groups[g.group]
            if comm is not None:
                requests.append(comm.Iallgatherv(self._MPI.IN_PLACE, [result, (
                    [counts[m] if gives else 0 for m, gives in zip(g.group, g.contributes)],
                    [displs[m] for m in g.group]), mpi_type]))
        self._finish(requests, total * info.itemsize <= POLITE_MAX_BYTES)
        if self.local_size > 1:
            self.node_buffer.barrier()
            np.copyto(out, result)

    def close(self, collective: bool, abort: bool = False) -> None:
        if self.window is not None:
            self.window.close(collective)
        if self.node_buffer is not None:
            self.node_buffer.close(collective)
        if collective:   # freeing a communicator is collective over its ranks
            for comm in self._groups.values():
                if comm is not None:
                    comm.Free()
            if self.local is not None:
                self.local.Free()
        self._groups.clear()
        self.window = self.node_buffer = self.local = None


class MpiCrossing:
    """A share's exchange across hosts in pieces (:func:`~.hier_plan.cross_pieces`), for
    :meth:`DirectCopies.allreduce_one`: one non-blocking allreduce per piece in its segment's
    group, all of a rank's in flight together (a rank in several groups would otherwise carry
    its segments one after another)."""

    def __init__(self, path: HierarchicalPath, batch: Batch, cut: list, mpi_type, mpi_op,
                 polite: bool) -> None:
        self.pieces = [(p.lo, p.hi) for p in cut]
        self._comms = [path._group(p.group) for p in cut]
        self._path, self._batch = path, batch
        self._type, self._op, self._polite = mpi_type, mpi_op, polite
        self.requests: list = [None] * len(cut)

    def start(self, index: int, view: np.ndarray) -> None:
        if index == 0:
            phase(self._batch, "MPI_CROSS_ALLREDUCE")
        self.requests[index] = self._comms[index].Iallreduce(
            self._path._MPI.IN_PLACE, [view, self._type], self._op)

    def done(self, index: int) -> bool:
        return self.requests[index].Test()

    def finish(self, index: int) -> None:
        self._path._finish(self.requests[index], self._polite)


class _AllOf:
    """Several requests tested as one (``Test`` is true once every one has completed)."""

    def __init__(self, requests: list, testall) -> None:
        self.requests, self._testall = requests, testall

    def Test(self) -> bool:
        return self._testall(self.requests)
