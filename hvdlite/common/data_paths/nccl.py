"""The NCCL data path for GPU buffers (CuPy's NCCL binding), one communicator per process set.

The communicator is created the first time a set runs a GPU operation: rank 0 of the set makes an
NCCL unique id and the set's MPI communicator broadcasts it.  Every rank executes the same
negotiated responses in the same order, so every member reaches that point together.  Work is
queued on hvdlite's stream of the process's GPU; :meth:`execute` returns an event behind it.

Small allreduces are packed into a persistent device fusion buffer (one device-to-device copy
each), reduced with one NCCL call and unpacked the same way; a lone tensor is reduced in place.
Allgather and broadcast move bytes, so they take every dtype.  Operations NCCL has no direct
form for (alltoall, reducescatter, Adasum) are left to the staged path next in the engine's list.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from hvdlite.common.data_paths.helpers import postscale_factor
from hvdlite.common.dtypes import dtype_info
from hvdlite.common.engine.data_path import Batch, DataPath, DeviceWork, PathContext
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, Response
from hvdlite.common.errors import GpuUnavailableError, HvdliteError
from hvdlite.common.gpu import cuda
from hvdlite.common.reduce_ops import ReduceOp
from hvdlite.common.runtime.waiting import wait_until

# ncclDataType_t and ncclRedOp_t values (nccl.h; CuPy exposes the same numbers).
NCCL_TYPES = {"int8": 0, "uint8": 1, "bool": 1, "int32": 2, "uint32": 3, "int64": 4,
              "uint64": 5, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_SUM, _NCCL_PROD, _NCCL_MAX, _NCCL_MIN = 0, 1, 2, 3
_NCCL_OPS = {ReduceOp.Sum: _NCCL_SUM, ReduceOp.Average: _NCCL_SUM, ReduceOp.Product: _NCCL_PROD,
             ReduceOp.Max: _NCCL_MAX, ReduceOp.Min: _NCCL_MIN}
# bool travels as bytes 0/1: "or" is max, "and" is min (the CPU path's LOR/LAND).
_NCCL_BOOL_OPS = {ReduceOp.Sum: _NCCL_MAX, ReduceOp.Max: _NCCL_MAX, ReduceOp.Min: _NCCL_MIN,
                  ReduceOp.Product: _NCCL_MIN}
_NCCL_BYTES = 1   # ncclUint8: allgather and broadcast move raw bytes
_UNIQUE_ID_BYTES = 128   # NCCL_UNIQUE_ID_BYTES (nccl.h)


def unique_id_to_array(uid: Any) -> np.ndarray:
    """NCCL's unique id as the int8 array that MPI broadcasts.  CuPy 14 returns ``bytes``;
    earlier CuPy returns a tuple of 128 signed ints."""
    if isinstance(uid, (bytes, bytearray)):
        arr = np.frombuffer(bytes(uid), dtype=np.int8).copy()
    else:
        arr = np.array([int(b) for b in uid], dtype=np.int64).astype(np.int8)
    if arr.size != _UNIQUE_ID_BYTES:
        raise HvdliteError(f"NCCL's unique id has {arr.size} bytes, expected "
                           f"{_UNIQUE_ID_BYTES}: this CuPy/NCCL pairing is not supported.")
    return arr


def unique_id_for_binding(arr: np.ndarray, cupy_version: str) -> bytes | tuple[int, ...]:
    """The broadcast id in the form ``NcclCommunicator`` takes: bytes from CuPy 14 on, a tuple
    of signed ints before (CuPy's own ``get_unique_id`` return type of that version)."""
    if int(cupy_version.split(".")[0]) >= 14:
        return arr.tobytes()
    return tuple(int(b) for b in arr)


@functools.lru_cache(maxsize=None)
def _nccl_type_and_op(dtype_name: str, reduce_op: int) -> tuple[int, int]:
    """NCCL's data type and reduction for a response's dtype and op (looked up once each)."""
    op = ReduceOp(reduce_op)
    nccl_op = _NCCL_BOOL_OPS[op] if dtype_info(dtype_name).is_bool else _NCCL_OPS[op]
    return NCCL_TYPES[dtype_name], nccl_op


def nccl_reduce_check(dtype_name: str, op: ReduceOp, what: str) -> None:
    """Raise at submission (before anything is in flight) for reductions NCCL cannot do."""
    if op == ReduceOp.Adasum:
        return   # runs host-staged
    if dtype_name not in NCCL_TYPES:
        raise GpuUnavailableError(
            f"{what}: NCCL has no {dtype_name} reduction. Cast the tensor (e.g. int16 to int32) "
            f"or set HVDLITE_GPU_OPERATIONS=mpi to reduce GPU tensors through host memory.")


class NCCLPath(DataPath):
    """Allreduce (but Adasum), allgather, broadcast and barrier of GPU tensors through NCCL,
    when ``HVDLITE_GPU_OPERATIONS=nccl`` (the default)."""

    name = "nccl"
    device = True

    def __init__(self, context: PathContext, runtime=None) -> None:
        super().__init__(context)
        self._agree = context.agree   # every rank prepared its part, or all fail
        self._runtime = runtime       # None: the process's GPU runtime, looked up when used
        self._local_rank_of = {g: i for i, g in enumerate(context.global_ranks)}
        self._nccl_comm = None
        self._fusion: Any = None   # device uint8 buffer, grown on demand, never shrunk

    @property
    def _rt(self):
        return self._runtime if self._runtime is not None else cuda.runtime()

    def enabled(self, batch: Batch) -> bool:
        response = batch[0][0]
        return (response.device >= 0 and self.context.config.gpu_operations == "nccl"
                and response.kind in (ALLREDUCE, ALLGATHER, BROADCAST, BARRIER)
                and response.reduce_op != ReduceOp.Adasum)

    # --- communicator -----------------------------------------------------------------------
    def _communicator(self, device_id: int):
        # One GPU per process is enforced at submission (cuda.claim_device), so the device
        # never changes under a communicator.
        if self._nccl_comm is not None:
            return self._nccl_comm
        nccl = self._rt.require_nccl("creating the NCCL communicator")
        # Byte 0 says whether rank 0 made an id, so that a failure there reaches every rank
        # at once instead of leaving the others waiting for an id that never comes.
        message = np.zeros(1 + _UNIQUE_ID_BYTES, dtype=np.int8)
        failure = None
        if self.rank == 0:
            try:
                message[1:] = unique_id_to_array(nccl.get_unique_id())
                message[0] = 1
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the broadcast
                failure = exc
        request = self.comm.Ibcast(message, root=0)   # non-blocking: a dead rank is noticed
        wait_until(request.Test, max_sleep=1e-3, on_slow=self._init_slow, slow_every=30.0)
        if failure is not None:
            raise HvdliteError(f"NCCL could not create its unique id on rank 0: "
                               f"{failure}") from failure
        if message[0] != 1:
            raise HvdliteError("creating the NCCL communicator: rank 0 of the process set could "
                               "not create NCCL's unique id (its error says why).")
        uid = message[1:]
        cp = self._rt.require("creating the NCCL communicator")
        try:
            with cp.cuda.Device(device_id):
                self._nccl_comm = nccl.NcclCommunicator(
                    self.size, unique_id_for_binding(uid, cp.__version__), self.rank)
        except Exception as exc:
            raise HvdliteError(
                f"NCCL could not create its communicator on cuda:{device_id} (rank "
                f"{self.rank} of {self.size}): {exc}. NCCL needs a distinct GPU per rank; ranks "
                f"that share one GPU must use HVDLITE_GPU_OPERATIONS=mpi.") from exc
        return self._nccl_comm

    @staticmethod
    def _init_slow(waited: float) -> None:
        if waited > 120.0:
            raise HvdliteError("creating the NCCL communicator: rank 0's unique id did not "
                               "arrive within 120 s.")

    def close(self, collective: bool = False, abort: bool = False) -> None:
        """Destroy the communicator (abort it instead when peers may be gone: that unblocks
        kernels still waiting for them)."""
        comm, self._nccl_comm = self._nccl_comm, None
        if comm is not None:
            comm.abort() if abort else comm.destroy()
        self._fusion = None

    # --- execution ----------------------------------------------------------------------------
    def execute(self, batch: Batch) -> DeviceWork:
        device_id = cuda.process_device(self.context.rank)
        response = batch[0][0]
        nccl_comm = self._communicator(device_id)
        rt = self._rt
        keep: list = []
        with rt.on(device_id) as stream:
            entries, call, error = batch, None, None
            try:   # everything local (copies, packing, prescaling, allocations) comes first
                entries = [(r, self._on_device(e, keep)) for r, e in batch]
                if response.kind == ALLREDUCE and len(entries) == 1:
                    call = self._allreduce_one(nccl_comm, stream, *entries[0])
                elif response.kind == ALLREDUCE:
                    call = self._allreduce_fused(nccl_comm, stream, entries)
                elif response.kind == ALLGATHER:
                    call = self._allgather(nccl_comm, stream, *entries[0])
                elif response.kind == BROADCAST:
                    call = self._broadcast(nccl_comm, stream, *entries[0])
            except Exception as exc:   # noqa: BLE001 - reported to every rank by agree()
                error = exc
            self._agree(error)
            if call is not None:
                call()   # the NCCL collective and the local work after it
            event = rt.record(device_id)
        return DeviceWork(event, keep, device_id)

    def _on_device(self, entry: Entry, keep: list) -> Entry:
        """A joined rank's identity is made on the host; give NCCL a device copy of it."""
        if entry.stand_in:
            cp = self._rt.require("join")
            entry.array = cp.asarray(entry.array.view(np.uint16) if
                                     entry.array.dtype.name == "bfloat16" else entry.array)
            entry.output = entry.array
            keep.append(entry.array)
        return entry

    def _reduce(self, nccl_comm, stream, src, dst, count: int, response: Response) -> None:
        if count == 0:
            return   # same on every rank (shapes are negotiated); empty buffers may be null
        nccl_type, nccl_op = _nccl_type_and_op(response.dtype, response.reduce_op)
        nccl_comm.allReduce(src.data.ptr, dst.data.ptr, count, nccl_type, nccl_op, stream.ptr)

    def _postscale(self, out, response: Response) -> None:
        if not dtype_info(response.dtype).is_bool:
            self._rt.scale(out, postscale_factor(response, self.size), response.dtype)

    def _allreduce_one(self, nccl_comm, stream, response: Response, entry: Entry) -> None:
        src, out = entry.array, entry.output   # contiguous (checked at submission), any shape
        if response.prescale != 1.0 and not entry.stand_in:
            if entry.output is not entry.array:
                out[...] = src   # scale a copy: the caller's input stays untouched
                src = out
            self._rt.scale(src, response.prescale, response.dtype)

        def call() -> None:
            self._reduce(nccl_comm, stream, src, out, src.size, response)
            self._postscale(out, response)
        return call

    def _allreduce_fused(self, nccl_comm, stream, batch: list[tuple[Response, Entry]]) -> None:
        response = batch[0][0]
        arrays = [e.array for _, e in batch]
        itemsize = arrays[0].itemsize
        total = sum(a.size for a in arrays)
        buf = self._fusion_view(total * itemsize, arrays[0].dtype)
        self._rt.concatenate_into(arrays, buf)
        if response.prescale != 1.0:
            offset = 0
            for (_, entry), array in zip(batch, arrays):
                if not entry.stand_in:   # a joined rank's identity must stay neutral
                    self._rt.scale(buf[offset:offset + array.size], response.prescale,
                                   response.dtype)
                offset += array.size

        def call() -> None:
            self._reduce(nccl_comm, stream, buf, buf, total, response)
            self._postscale(buf, response)
            self._rt.split_into(buf, [entry.output for _, entry in batch])
        return call

    def _fusion_view(self, nbytes: int, dtype):
        if self._fusion is None or self._fusion.nbytes < nbytes:
            cp = self._rt.require("fusion")
            self._fusion = None   # free the old buffer before allocating the larger one
            self._fusion = cp.empty(nbytes, dtype=np.uint8)
        return self._fusion[:nbytes].view(dtype)

    def _allgather(self, nccl_comm, stream, response: Response, entry: Entry) -> None:
        info = dtype_info(response.dtype)
        row_shape = tuple(response.shape[1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * entry.array.itemsize
        out_shape = (sum(response.first_dims),) + row_shape
        entry.output = entry.allocate(out_shape, info.np_dtype)
        counts = [d * row_bytes for d in response.first_dims]
        src, out = entry.array, entry.output
        nccl = self._rt.require_nccl("allgather")

        def call() -> None:
            if not any(counts):
                return
            if len(set(counts)) == 1:
                nccl_comm.allGather(src.data.ptr, out.data.ptr, counts[0], _NCCL_BYTES,
                                    stream.ptr)
                return
            nccl.groupStart()   # uneven rows: one broadcast per rank, as one NCCL group
            try:
                offset = 0
                for root, count in enumerate(counts):
                    if count:
                        send = src.data.ptr if root == self.rank else out.data.ptr + offset
                        nccl_comm.broadcast(send, out.data.ptr + offset, count, _NCCL_BYTES,
                                            root, stream.ptr)
                    offset += count
            finally:
                nccl.groupEnd()
        return call

    def _broadcast(self, nccl_comm, stream, response: Response, entry: Entry) -> None:
        root = self._local_rank_of[response.root]
        src, out = entry.array, entry.output

        def call() -> None:
            if out.nbytes:
                nccl_comm.broadcast(src.data.ptr, out.data.ptr, out.nbytes, _NCCL_BYTES, root,
                                    stream.ptr)
        return call
