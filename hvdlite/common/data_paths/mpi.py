"""The MPI data path for host buffers: every operation, on numpy views, through MPI calls.

The fallback of the host paths (it serves any batch): allreduce (one tensor in place, or a fused
batch through the host fusion buffer; at one rank only the copy and the scaling), allgather and
reducescatter (one tensor, or a fused batch as one ``Allgatherv`` / ``Reduce_scatter``: each
rank's rows of every member back to back), broadcast, alltoall and barrier.  The intra-node paths (direct copies, the
shared-memory window) and Adasum come before it in the engine's list.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from hvdlite.common.dtypes import (dtype_info, mpi_datatype, mpi_reduce_op, scale_in_place,
                                   scale_into)
from hvdlite.common.data_paths.helpers import (POLITE_MAX_BYTES, allreduce_alone, copy_out_pieces,
                                              displacements, flat, pack, phase,
                                              postscale_factor, row_layout, wait_inside_mpi)
from hvdlite.common.engine.data_path import Batch, DataPath, PathContext
from hvdlite.common.engine.fusion import FusionBuffer
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST,
                                            REDUCESCATTER, Response, split_rows)
from hvdlite.common.intranode.shared_window import all_on_one_node
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime.waiting import PEER_SPIN_SECONDS, wait_until

class MPIPath(DataPath):
    """Every host operation through MPI (see the module's docstring)."""

    name = "mpi"
    reduces_early = True

    def __init__(self, context: PathContext) -> None:
        super().__init__(context)
        from mpi4py import MPI
        self._MPI = MPI
        # Roots arrive as global ranks; MPI wants the rank in this process set's communicator.
        self._local_rank_of = {g: i for i, g in enumerate(context.global_ranks)}
        self._fusion = FusionBuffer()
        self._results = FusionBuffer()   # a fused allgather's or reducescatter's result
        self.fused_gathers = 0           # fused allgather/reducescatter batches (tests look)
        self._max_sleep = context.max_sleep
        self._on_slow = context.on_slow
        self._across_hosts: bool | None = None   # decided collectively on first need
        self._early_send, self._early_recv = FusionBuffer(), FusionBuffer()
        self._early_result: np.ndarray | None = None

    def enabled(self, batch: Batch) -> bool:
        return batch[0][0].device < 0

    def _postscale(self, response: Response) -> float:
        return postscale_factor(response, self.size)

    def _reduce(self, buf: np.ndarray, response: Response, info) -> None:
        """In-place MPI reduction of ``buf`` across the set."""
        self._allreduce(self._MPI.IN_PLACE, [buf, mpi_datatype(info)],
                        mpi_reduce_op(info, ReduceOp(response.reduce_op)), buf.nbytes)

    def _allreduce(self, send, recv, op, nbytes: int) -> None:
        if nbytes <= POLITE_MAX_BYTES:
            self._wait(self.comm.Iallreduce(send, recv, op=op))
        elif self._spans_hosts():   # MPICH's non-blocking algorithm is twice as fast there
            wait_inside_mpi(self.comm.Iallreduce(send, recv, op=op))
        else:   # on one host MPICH's blocking in-place allreduce is the faster (7 against 15
            self.comm.Allreduce(send, recv, op=op)   # ms at 2 ranks, 16 MiB)

    def _spans_hosts(self) -> bool:
        """Whether the set's ranks are on several hosts (collective on the first call: every
        rank asks it for the same batch)."""
        if self._across_hosts is None:
            self._across_hosts = not all_on_one_node(self.comm)
        return self._across_hosts

    def _wait(self, request) -> None:
        wait_until(request.Test, self._max_sleep, on_slow=self._on_slow,
                   spin_seconds=PEER_SPIN_SECONDS)

    def execute(self, batch: Batch) -> None:
        """Run one planned batch; on return every entry's ``output`` holds its result."""
        response, entry = batch[0]
        if response.kind == ALLREDUCE and self.size == 1:
            for response, entry in batch:   # nothing to exchange: copy (if needed) and scale
                allreduce_alone(response, entry, self.size)
        elif response.kind == ALLREDUCE:
            if len(batch) == 1:
                self._allreduce_one(response, entry)
            else:
                self._allreduce_fused(batch)
        elif response.kind == ALLGATHER:
            if len(batch) == 1:
                self._allgather(response, entry)
            else:
                self._allgather_fused(batch)
        elif response.kind == BROADCAST:
            self._broadcast(response, entry)
        elif response.kind == ALLTOALL:
            self._alltoall(response, entry)
        elif response.kind == REDUCESCATTER:
            if len(batch) == 1:
                self._reducescatter(response, entry)
            else:
                self._reducescatter_fused(batch)
        elif response.kind == BARRIER:
            pass  # negotiation completing on every rank *is* the barrier
        else:
            raise ValueError(f"unknown operation {response.kind!r}")

    def start_early(self, response: Response, entry: Entry | None) -> Callable[[], bool]:
        # What _allreduce_one does, on copies: the prescaled input, reduced out of place.
        info = dtype_info(response.dtype)
        nbytes = math.prod(response.shape) * info.itemsize
        send = self._early_send.view(nbytes, info.np_dtype)
        recv = self._early_recv.view(nbytes, info.np_dtype)
        if entry is not None:
            scale_into(send, flat(entry.array), response.prescale)
        self._early_result = recv
        mpi_type = mpi_datatype(info)
        return self.comm.Iallreduce([send, mpi_type], [recv, mpi_type],
                                    op=mpi_reduce_op(info, ReduceOp(response.reduce_op))).Test

    def finish_early(self, response: Response, entry: Entry) -> None:
        out = flat(entry.output)
        np.copyto(out, self._early_result)
        scale_in_place(out, self._postscale(response))

    def _allreduce_one(self, response: Response, entry: Entry) -> None:
        info = dtype_info(response.dtype)
        src = entry.array.reshape(-1)
        out = entry.output.reshape(-1)
        phase(((response, entry),), "MPI_ALLREDUCE")
        if entry.output is entry.array:   # in place: no copy at all
            if not entry.stand_in:        # the identity must stay neutral
                scale_in_place(out, response.prescale)
            self._reduce(out, response, info)
        elif response.prescale == 1.0:
            op = mpi_reduce_op(info, ReduceOp(response.reduce_op))
            mpi_type = mpi_datatype(info)
            self._allreduce([src, mpi_type], [out, mpi_type], op, out.nbytes)
        else:
            np.copyto(out, src)
            scale_in_place(out, response.prescale)
            self._reduce(out, response, info)
        scale_in_place(out, self._postscale(response))

    def _allreduce_fused(self, batch: Batch) -> None:
        response = batch[0][0]
        info = dtype_info(response.dtype)
        sizes = [e.array.size for _, e in batch]
        count = sum(sizes)
        buf = self._fusion.view(count * info.itemsize, info.np_dtype)
        pack(batch, buf, sizes, response.prescale)
        phase(batch, "MPI_ALLREDUCE")
        self._reduce(buf, response, info)
        phase(batch, "MEMCPY_OUT_FUSION_BUFFER")
        copy_out_pieces([flat(entry.output) for _, entry in batch], sizes, [(0, count, buf)],
                        self._postscale(response))

    def _allgather(self, response: Response, entry: Entry) -> None:
        info = dtype_info(response.dtype)
        row_shape, row = row_layout(response.shape)
        out_shape = (sum(response.first_dims),) + row_shape
        entry.output = entry.allocate(out_shape, info.np_dtype)
        counts = [d * row for d in response.first_dims]
        mpi_type = mpi_datatype(info)
        request = self.comm.Iallgatherv([entry.array.reshape(-1), mpi_type],
                                        [entry.output.reshape(-1),
                                         (counts, displacements(counts)), mpi_type])
        if entry.output.nbytes <= POLITE_MAX_BYTES:
            self._wait(request)
        else:
            wait_inside_mpi(request)   # (not the blocking call: see there)

    def _broadcast(self, response: Response, entry: Entry) -> None:
        info = dtype_info(response.dtype)
        out = entry.output.reshape(-1)
        root = self._local_rank_of[response.root]
        if self.rank == root and entry.output is not entry.array:
            np.copyto(out, entry.array.reshape(-1))
        self.comm.Bcast([out, mpi_datatype(info)], root=root)

    def _alltoall(self, response: Response, entry: Entry) -> None:
        """Rows ``splits[r][j]`` of rank r go to rank j; the result is the received rows in
        rank order, plus how many came from each rank."""
        info = dtype_info(response.dtype)
        row_shape, row = row_layout(response.shape)
        mine = response.splits[self.rank]
        received = [splits[self.rank] for splits in response.splits]
        out = entry.allocate((sum(received),) + row_shape, info.np_dtype)
        send_counts = [n * row for n in mine]
        recv_counts = [n * row for n in received]
        mpi_type = mpi_datatype(info)
        self.comm.Alltoallv([entry.array.reshape(-1), (send_counts, displacements(send_counts)),
                             mpi_type],
                            [out.reshape(-1), (recv_counts, displacements(recv_counts)),
                             mpi_type])
        entry.output = (out, np.array(received, dtype=np.int32))

    def _reducescatter(self, response: Response, entry: Entry) -> None:
        """Reduce across ranks; rank r keeps its share of the rows (see ``split_rows``)."""
        info = dtype_info(response.dtype)
        row_shape, row = row_layout(response.shape)
        rows = split_rows(response.shape[0], self.size)
        out = entry.allocate((rows[self.rank],) + row_shape, info.np_dtype)
        src = entry.array.reshape(-1)
        if response.prescale != 1.0:
            src = src.copy()
            scale_in_place(src, response.prescale)
        flat = out.reshape(-1)
        if self.size == 1:
            np.copyto(flat, src)
        else:
            self.comm.Reduce_scatter([src, mpi_datatype(info)], [flat, mpi_datatype(info)],
                                     [n * row for n in rows],
                                     op=mpi_reduce_op(info, ReduceOp(response.reduce_op)))
        if not info.is_bool:
            scale_in_place(flat, self._postscale(response))
        entry.output = out

    def _allgather_fused(self, batch: Batch) -> None:
        """Several allgathers of one dtype as one ``Allgatherv``: each rank sends its rows of
        every member back to back; each member's result is then cut out of every rank's
        block, in rank order."""
        response = batch[0][0]
        info = dtype_info(response.dtype)
        layouts = [row_layout(r.shape) for r, _ in batch]
        counts = [[d * row for d in r.first_dims] for (r, _), (_, row) in zip(batch, layouts)]
        per_rank = [sum(c[q] for c in counts) for q in range(self.size)]
        send = self._fusion.view(per_rank[self.rank] * info.itemsize, info.np_dtype)
        pack(batch, send, [c[self.rank] for c in counts], 1.0)
        recv = self._results.view(sum(per_rank) * info.itemsize, info.np_dtype)
        starts = displacements(per_rank)
        mpi_type = mpi_datatype(info)
        phase(batch, "MPI_ALLGATHER")
        request = self.comm.Iallgatherv([send, mpi_type], [recv, (per_rank, starts), mpi_type])
        if recv.nbytes <= POLITE_MAX_BYTES:
            self._wait(request)
        else:
            wait_inside_mpi(request)
        phase(batch, "MEMCPY_OUT_FUSION_BUFFER")
        for (response, entry), c, (row_shape, _) in zip(batch, counts, layouts):
            out = entry.allocate((sum(response.first_dims),) + row_shape, info.np_dtype)
            np.concatenate([recv[starts[q]:starts[q] + c[q]] for q in range(self.size)],
                           out=out.reshape(-1))
            for q in range(self.size):
                starts[q] += c[q]
            entry.output = out
        self.fused_gathers += 1

    def _reducescatter_fused(self, batch: Batch) -> None:
        """Several reducescatters of one dtype and op as one ``Reduce_scatter``: the send
        buffer holds, rank by rank, every member's rows for that rank (see ``split_rows``), so
        each rank receives its rows of every member back to back."""
        response = batch[0][0]
        info = dtype_info(response.dtype)
        layouts = [row_layout(r.shape) for r, _ in batch]
        rows = [split_rows(r.shape[0], self.size) for r, _ in batch]
        counts = [[n * row for n in member_rows]
                  for member_rows, (_, row) in zip(rows, layouts)]
        per_rank = [sum(c[q] for c in counts) for q in range(self.size)]
        send = self._fusion.view(sum(per_rank) * info.itemsize, info.np_dtype)
        phase(batch, "MEMCPY_IN_FUSION_BUFFER")
        at = displacements(per_rank)
        for (_, entry), c in zip(batch, counts):
            src, offset = entry.array.reshape(-1), 0
            for q in range(self.size):
                scale_into(send[at[q]:at[q] + c[q]], src[offset:offset + c[q]],
                           response.prescale)
                at[q] += c[q]
                offset += c[q]
        mine = per_rank[self.rank]
        recv = self._results.view(mine * info.itemsize, info.np_dtype)
        phase(batch, "MPI_REDUCESCATTER")
        if self.size == 1:
            np.copyto(recv, send)
        else:
            self.comm.Reduce_scatter([send, mpi_datatype(info)], [recv, mpi_datatype(info)],
                                     per_rank,
                                     op=mpi_reduce_op(info, ReduceOp(response.reduce_op)))
        phase(batch, "MEMCPY_OUT_FUSION_BUFFER")
        factor = 1.0 if info.is_bool else self._postscale(response)
        offset = 0
        for (_, entry), c, member_rows, (row_shape, _) in zip(batch, counts, rows, layouts):
            n = c[self.rank]
            out = entry.allocate((member_rows[self.rank],) + row_shape, info.np_dtype)
            scale_into(out.reshape(-1), recv[offset:offset + n], factor)
            offset += n
            entry.output = out
        self.fused_gathers += 1
