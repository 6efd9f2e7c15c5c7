"""A host-memory stand-in for hvdlite's GPU runtime, so machines without a GPU can run the
GPU data path's own logic (routing, host staging, fusion of device entries, completion through
the GPU completion thread, submission checks) under real MPI.

"Device arrays" are numpy arrays submitted with ``device=0`` through ``hvdlite.common.ops.submit``;
copies to and from the "device" are real copies, events are always complete.  What it cannot
check (CUDA streams, DLPack, NCCL itself) is covered by tests/gpu/ on a GPU machine.
"""
from __future__ import annotations

import contextlib
import types

import numpy as np

from hvdlite.common import cuda
from hvdlite.common.dtypes import scale_in_place
from hvdlite.common.errors import GpuUnavailableError


class _CupyStandIn:
    """What the core asks of CuPy itself rather than of the runtime: the current device
    (``cuda.process_device`` for a rank that joined before using any GPU tensor), numpy for
    everything else."""

    def __init__(self, runtime: "LoopbackRuntime") -> None:
        rt = runtime
        self.cuda = types.SimpleNamespace(
            Device=lambda device=None: types.SimpleNamespace(
                id=rt.device_id if device is None else int(device)))

    def __getattr__(self, name):
        return getattr(np, name)


class LoopbackRuntime(cuda.GpuRuntime):
    device_id = 0   # the "GPU" every device array of this process is on

    def __init__(self, nccl: bool = False) -> None:
        super().__init__()
        self.nccl = nccl
        self.to_host_calls = 0
        self.to_device_calls = 0
        self.synchronize_calls = 0
        self.records = 0
        self._cupy = _CupyStandIn(self)

    def require(self, what):
        return self._cupy

    def require_nccl(self, what):
        if not self.nccl:
            raise GpuUnavailableError(
                f"{what}: HVDLITE_GPU_OPERATIONS=nccl (the default) but NCCL is not usable: "
                f"loopback runtime without NCCL. Either {cuda.INSTALL_HINT}, or set "
                f"HVDLITE_GPU_OPERATIONS=mpi to stage GPU tensors through host memory and "
                f"reduce them with MPI.")
        raise AssertionError("the loopback runtime has no NCCL to hand out")

    def stream(self, device_id):
        return None

    @contextlib.contextmanager
    def on(self, device_id):
        yield None

    def record(self, device_id):
        self.records += 1
        return object()

    @staticmethod
    def event_done(event):
        return True

    @staticmethod
    def event_wait(event):
        return None

    def synchronize(self, device_id):
        self.synchronize_calls += 1

    def device_view(self, obj, device_id, what):
        return obj

    def device_of(self, array):
        return self.device_id

    def empty(self, shape, dtype, device_id):
        return np.empty(shape, dtype=dtype)

    def to_host(self, array):
        self.to_host_calls += 1
        return np.array(array, copy=True)

    def to_device(self, host, array):
        self.to_device_calls += 1
        np.copyto(array, host)

    def concatenate_into(self, arrays, out):
        np.concatenate([a.ravel() for a in arrays], out=out)

    def scale(self, array, factor, dtype_name):
        scale_in_place(array, factor)


def install(nccl: bool = False) -> LoopbackRuntime:
    runtime = LoopbackRuntime(nccl)
    cuda.set_runtime_for_tests(runtime)
    return runtime
