"""Zero-copy handoff between torch tensors and the core's arrays.

CPU tensors become numpy views; CUDA tensors become CuPy views of their memory, and hvdlite's stream
is made to wait (on the device) for torch's current stream, which produced them: what a DLPack
exchange does, without its host cost (see ``hvdlite.common.gpu.cuda``).  The first CUDA tensor
registers torch's current stream as the one that waits for GPU results."""
from __future__ import annotations

import numpy as np
import torch

from hvdlite.common.core import UnsupportedDtypeError

# torch dtypes numpy cannot represent travel as same-width integer views.
_VIEW_AS = {torch.bfloat16: (torch.int16, "bfloat16")}
# torch dtypes whose core view keeps them as they are (bfloat16 is viewed as int16 first), and
# the element type of that view (CUDA tensors' device views need it spelled out).
NUMPY_DTYPES = {torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8),
                torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16),
                torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
                torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
                torch.float64: np.dtype(np.float64)}
_UNSUPPORTED_DTYPES = frozenset({torch.complex32, torch.complex64, torch.complex128, torch.uint16,
                                 torch.uint32, torch.uint64})
_UNSUPPORTED_HINT = ("cast it to a supported dtype (bool, uint8, int8, int16, int32, int64, "
                     "float16, bfloat16, float32, float64)")


def plain_cpu(tensor) -> bool:
    """Whether ``tensor`` is a plain, contiguous CPU tensor outside autograd whose numpy view
    (``tensor.numpy()``) is its core array as it is: the adapters' fast paths take those
    without the general checks (one call per tensor of every step)."""
    return (type(tensor) is torch.Tensor and not tensor.requires_grad and tensor.is_cpu
            and tensor.dtype in NUMPY_DTYPES and not tensor.is_sparse
            and tensor.is_contiguous())


# check_tensor and as_core_array run for every gradient of every step.  They use attributes
# rather than calls where torch has both: many torch calls (detach, numpy, view) release
# the interpreter lock, and while hvdlite's background thread polls, each such release can cost
# a lock round trip of several microseconds (measured: 200 submissions 5.6-6.3 ms against
# 1.5 ms for the same numpy arrays).
def check_tensor(tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}.")
    if not (tensor.is_cpu or tensor.is_cuda):
        raise UnsupportedDtypeError(
            f"{what}: tensor is on {tensor.device}; hvdlite moves CPU tensors (MPI) and CUDA "
            f"tensors (NCCL, or host-staged MPI). Move it with .cpu() or .cuda().")
    if tensor.is_sparse:
        raise UnsupportedDtypeError(
            f"{what}: sparse tensors are not supported; convert with .to_dense() (or use "
            f"DistributedOptimizer(sparse_as_dense=True)).")
    if tensor.dtype in _UNSUPPORTED_DTYPES:
        raise UnsupportedDtypeError(f"{what}: dtype {tensor.dtype} is not supported; "
                                    f"{_UNSUPPORTED_HINT}.")


def as_core_array(tensor: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """The core's view sharing ``tensor``'s memory (contiguous tensors only): numpy for CPU,
    CuPy for CUDA; and the dtype name to tell the core when the view's dtype is a stand-in."""
    view_as = _VIEW_AS.get(tensor.dtype)
    t = tensor.detach() if tensor.requires_grad else tensor   # (numpy() refuses those)
    if view_as is not None:
        t = t.view(view_as[0])
    if t.is_cuda:
        from hvdlite.common.core import cuda
        if cuda._consumer_stream is not _current_stream:
            cuda.set_consumer_stream(_current_stream)
        device = t.get_device()
        what = f"tensor on cuda:{device}"   # (formatting t.device costs ~10 us per gradient)
        rt = cuda.runtime()
        rt.wait_for_producer(_current_stream(device), device, what)
        array = rt.wrap_device_memory(t.data_ptr(), tuple(t.shape), NUMPY_DTYPES[t.dtype],
                                      device, t, what)
    else:
        array = t.numpy()
    return array, (view_as[1] if view_as is not None else None)


def order_after_producer(tensor: torch.Tensor) -> None:
    """Make hvdlite's stream wait (on the device) for the work queued so far on the calling
    thread's current stream, which produced the CUDA ``tensor`` (as :func:`as_core_array`
    does, for a tensor whose core view is kept from an earlier call)."""
    from hvdlite.common.core import cuda
    device = tensor.get_device()
    cuda.runtime().wait_for_producer(_current_stream(device), device, "tensor on a GPU")


# torch's own accessor of the raw current stream (what torch.compile's generated code calls);
# torch.cuda.current_stream() builds a Stream object around the same pointer, which costs more
# on a path that runs for every gradient and every wait.
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_id: int) -> int:
    """The calling thread's current torch stream on ``device_id`` (a raw ``cudaStream_t``):
    hvdlite's stream waits for it before reading a tensor, and it is made to wait for
    hvdlite's work when a result is handed over
   (``hvdlite.common.gpu.cuda.wait_for_device_work``)."""
    if _raw_current_stream is not None:
        return _raw_current_stream(device_id)
    return torch.cuda.current_stream(device_id).cuda_stream


def empty_core_backed(shape: tuple, like: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """A new contiguous tensor of ``like``'s dtype on ``like``'s device, and its core view."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    return out, as_core_array(out)[0]
