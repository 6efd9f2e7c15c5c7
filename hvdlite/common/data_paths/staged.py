"""GPU tensors through host memory (``HVDLITE_GPU_OPERATIONS=mpi``).

Each input is copied from the device into pinned host memory on hvdlite's stream, the host copies
go through the host paths (so every operation, fusion and reduce op behaves exactly as for CPU
tensors), and the results are copied back on the same stream.  This is the path for ranks that
share one GPU (NCCL refuses two ranks on one device) and for machines without NCCL; it also
serves the operations the NCCL path leaves (alltoall, reducescatter, Adasum).
"""
from __future__ import annotations

import numpy as np

from hvdlite.common.data_paths.adasum import AdasumPath
from hvdlite.common.data_paths.mpi import MPIPath
from hvdlite.common.dtypes import dtype_info
from hvdlite.common.engine.data_path import Batch, DataPath, DeviceWork, PathContext, select
from hvdlite.common.engine.handle import Entry
from hvdlite.common.gpu import cuda


def _host_allocate(shape: tuple, dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


class StagedPath(DataPath):
    """Any GPU batch, through host memory and the host paths (Adasum, MPI).  The engine's
    ``agree`` check (every rank prepared its part, or all fail) runs before the collective, so
    no rank is left alone inside it."""

    name = "staged"
    device = True

    def __init__(self, context: PathContext, runtime=None) -> None:
        super().__init__(context)
        self._runtime = runtime   # None: the process's GPU runtime, looked up when used
        self._agree = context.agree
        # plain MPI on the host copies (no shared window, no direct copies: staging dominates)
        self._host_paths = [AdasumPath(context), MPIPath(context)]

    @property
    def _rt(self):
        return self._runtime if self._runtime is not None else cuda.runtime()

    def enabled(self, batch: Batch) -> bool:
        return batch[0][0].device >= 0

    def execute(self, batch: Batch) -> DeviceWork:
        """Run ``batch`` (device entries); returns the work whose event fires once every result
        is back on the device, holding the host buffers that must live until then."""
        device_id = cuda.process_device(self.context.rank)
        return self.execute_on(batch, device_id)

    def execute_on(self, batch: Batch, device_id: int) -> DeviceWork:
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
                    host_batch.append((response._replace(device=-1), staged))   # on the host now
                rt.synchronize(device_id)   # MPI reads host memory: the copies must have landed
            except Exception as exc:   # noqa: BLE001 - reported to every rank by agree()
                error = exc
            self._agree(error)
            select(self._host_paths, host_batch).execute(host_batch)
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
        return DeviceWork(event, host_batch, device_id)

    def _to_host(self, array, info) -> np.ndarray:
        host = self._rt.to_host(array)
        # bfloat16 travels on the device as its 16-bit pattern; MPI reduces the real dtype
        return host.view(info.np_dtype) if host.dtype != info.np_dtype else host
