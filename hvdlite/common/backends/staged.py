"""GPU tensors through host memory (``HVDLITE_GPU_OPERATIONS=mpi``).

Each input is copied from the device into pinned host memory on hvdlite's stream, the host copies
go through the ordinary MPI backend (so every operation, fusion and reduce op behaves exactly as
for CPU tensors), and the results are copied back on the same stream.  This is the path for ranks
that share one GPU (NCCL refuses two ranks on one device) and for machines without NCCL; the NCCL
backend also uses it for the operations NCCL has no direct form for (alltoall, reducescatter,
Adasum).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hvdlite.common.backends.mpi import MPIBackend
from hvdlite.common.dtypes import dtype_info
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import Response


def _host_allocate(shape: tuple, dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


class HostStagedBackend:
    """``agree(error)`` is the engine's check that every rank prepared its part of a batch: it
    raises on every rank if any rank failed, so no rank is left alone inside a collective."""

    def __init__(self, comm, global_ranks: list[int] | None, runtime, agree) -> None:
        self._mpi = MPIBackend(comm, global_ranks)
        self._rt = runtime
        self._agree = agree

    def execute(self, batch: list[tuple[Response, Entry]], device_id: int) -> tuple[Any, list]:
        """Run ``batch`` (device entries); returns the event that fires once every result is
        back on the device, and the host buffers that must live until then."""
        rt = self._rt
        info = dtype_info(batch[0][0].dtype)
        with rt.on(device_id):
            host_batch, error = [], None
            try:
                for response, entry in batch:   # a joined rank's identity is already on the host
                    host_in = entry.array if entry.stand_in else self._to_host(entry.array, info)
                    in_place = entry.output is entry.array
                    host_out = host_in if in_place else (
                        None if entry.output is None else np.empty(entry.output.shape,
                                                                   info.np_dtype))
                    staged = Entry(entry.request, host_in, host_out, _host_allocate, None)
                    staged.stand_in = entry.stand_in
                    host_batch.append((response, staged))
                rt.synchronize(device_id)   # MPI reads host memory: the copies must have landed
            except Exception as exc:   # noqa: BLE001 - reported to every rank by agree()
                error = exc
            self._agree(error)
            self._mpi.execute(host_batch)
            for (_, entry), (_, staged) in zip(batch, host_batch):
                if entry.stand_in:
                    continue   # a joined rank's identity: nobody reads its result
                result, extra = staged.output, None
                if isinstance(result, tuple):   # alltoall: (rows, splits received)
                    result, extra = result
                if entry.output is None:
                    device_out = entry.allocate(result.shape, info.np_dtype)
                    entry.output = device_out if extra is None else (device_out, extra)
                device_out = entry.output if extra is None else entry.output[0]
                device_dtype = device_out.dtype
                rt.to_device(result.view(device_dtype) if result.dtype != device_dtype
                             else result, device_out)
            event = rt.record(device_id)
        return event, host_batch

    def _to_host(self, array, info) -> np.ndarray:
        host = self._rt.to_host(array)
        # bfloat16 travels on the device as its 16-bit pattern; MPI reduces the real dtype
        return host.view(info.np_dtype) if host.dtype != info.np_dtype else host
