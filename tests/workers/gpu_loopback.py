"""A host-memory stand-in for hvdlite's GPU runtime, so machines without a GPU can run the
GPU data path's own logic (routing, host staging, fusion of device entries, completion through
the GPU completion thread, submission checks) under real MPI.

"Device arrays" are numpy arrays submitted with ``device=0`` through
``hvdlite.common.api.ops.submit``; copies to and from the "device" are real copies, and events
fire when recorded unless a test holds them back (``hold_events``).  Device-side stream waits are recorded, not performed.  What it
cannot check (CUDA streams, DLPack, NCCL itself) is covered by tests/gpu/ on a GPU machine.
"""
from __future__ import annotations

import contextlib
import threading
import types

import numpy as np

from hvdlite.common.gpu import cuda
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


class LoopbackEvent:
    """A recorded "event": fired at once, or when the test releases the held ones."""

    def __init__(self, fired: bool) -> None:
        self.fired = threading.Event()
        if fired:
            self.fired.set()


class LoopbackRuntime(cuda.GpuRuntime):
    device_id = 0   # the "GPU" every device array of this process is on

    def __init__(self, nccl: bool = False) -> None:
        super().__init__()
        self.nccl = nccl
        self.to_host_calls = 0
        self.to_device_calls = 0
        self.synchronize_calls = 0
        self.records = 0
        self.hold_events = False   # events recorded meanwhile fire only at release_events()
        self.held: list[LoopbackEvent] = []
        self.stream_waits: list[tuple[int, bool]] = []   # (stream, event fired by then)
        self.host_waits: list[str] = []                   # thread names of event_wait calls
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
        event = LoopbackEvent(fired=not self.hold_events)
        if self.hold_events:
            self.held.append(event)
        return event

    def release_events(self) -> None:
        held, self.held = self.held, []
        for event in held:
            event.fired.set()

    @staticmethod
    def event_done(event):
        return event.fired.is_set()

    def event_wait(self, event):
        self.host_waits.append(threading.current_thread().name)
        if not event.fired.wait(30.0):   # bounded: a broken test fails, it does not hang
            raise RuntimeError("loopback event never released (test bug)")

    def stream_wait(self, event, stream_ptr):
        self.stream_waits.append((stream_ptr, event.fired.is_set()))

    def synchronize(self, device_id):
        self.synchronize_calls += 1

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

    def split_into(self, buf, outs):
        offset = 0
        for o in outs:
            o.reshape(-1)[...] = buf[offset:offset + o.size]
            offset += o.size

    def scale(self, array, factor, dtype_name):
        scale_in_place(array, factor)


def install(nccl: bool = False) -> LoopbackRuntime:
    runtime = LoopbackRuntime(nccl)
    cuda.set_runtime_for_tests(runtime)
    return runtime
