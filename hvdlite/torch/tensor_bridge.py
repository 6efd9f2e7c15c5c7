"""Zero-copy handoff between torch CPU tensors and the core's numpy views."""
from __future__ import annotations

import numpy as np
import torch

from hvdlite.common.errors import UnsupportedDtypeError

# torch dtypes numpy cannot represent travel as same-width integer views.
_VIEW_AS = {torch.bfloat16: (torch.int16, "bfloat16")}
_UNSUPPORTED_HINT = ("cast it to a supported dtype (bool, uint8, int8, int16, int32, int64, "
                     "float16, bfloat16, float32, float64)")


def check_tensor(tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.device.type != "cpu":
        raise UnsupportedDtypeError(
            f"{what}: tensor is on {tensor.device}; this hvdlite build has no GPU data path "
            f"(NCCL) enabled, so only CPU tensors are supported. Move it with .cpu().")
    if tensor.is_sparse:
        raise UnsupportedDtypeError(
            f"{what}: sparse tensors are not supported; convert with .to_dense() (or use "
            f"DistributedOptimizer(sparse_as_dense=True)).")
    if tensor.is_complex() or tensor.dtype in (torch.uint16, torch.uint32, torch.uint64):
        raise UnsupportedDtypeError(f"{what}: dtype {tensor.dtype} is not supported; "
                                    f"{_UNSUPPORTED_HINT}.")


def as_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """Numpy view sharing ``tensor``'s memory (contiguous tensors only), and the dtype name to
    tell the core when numpy cannot express the dtype itself."""
    view_as = _VIEW_AS.get(tensor.dtype)
    t = tensor.detach()
    if view_as is not None:
        return t.view(view_as[0]).numpy(), view_as[1]
    return t.numpy(), None


def empty_numpy_backed(shape: tuple, like: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """A new contiguous tensor of ``like``'s dtype and its numpy view."""
    out = torch.empty(shape, dtype=like.dtype)
    return out, as_numpy(out)[0]
