"""Horovod-compatible allreduce of torch sparse COO tensors (e.g. ``nn.Embedding(sparse=True)``
gradients).

A sparse tensor cannot be summed element-wise on the wire without densifying it, so -- as in
Horovod -- every rank's non-zero entries are *allgathered* instead: the indices and the values go
out as two allgathers (the number of non-zeros may differ per rank), and every rank rebuilds the
same sparse result from the concatenation, summing entries that several ranks share.  This pays
off when each rank touches a small part of a large tensor; otherwise ``sparse_as_dense=True``
(DistributedOptimizer) or ``tensor.to_dense()`` with a normal allreduce is cheaper.
"""
from __future__ import annotations

import torch

from hvdlite.common.core import Handle, ReduceOp, resolve_op, size, sparse_postscale

from .mpi_ops import allgather_async, synchronize
from .tensor_bridge import check_tensor

_SUPPORTED_OPS = (ReduceOp.Average, ReduceOp.Sum)


def _scale(values: torch.Tensor, factor: float) -> torch.Tensor:
    """``values * factor`` with the dense allreduce's rounding rules, so sparse and dense
    reductions of the same data agree: integers are scaled in float64 and truncated toward zero,
    16-bit floats are scaled in float32."""
    if factor == 1.0 or values.numel() == 0:
        return values
    dtype = values.dtype
    if not dtype.is_floating_point:
        return (values.to(torch.float64) * factor).trunc().to(dtype)
    if dtype.itemsize < 4:
        return (values.to(torch.float32) * factor).to(dtype)
    return values * factor


def _group_size(process_set) -> int:
    if process_set is None:
        return size()
    set_size = getattr(process_set, "size", None)
    return int(set_size()) if callable(set_size) else size()


def _check_bounds(indices: torch.Tensor, shape: torch.Size, what: str) -> None:
    """Other ranks' indices must fit this rank's shape: a sparse tensor with out-of-range
    indices is not checked by torch and corrupts memory later.  (The dense dimensions are
    already checked by the values' allgather.)"""
    if indices.shape[1] == 0:
        return
    limits = torch.tensor(shape[:indices.shape[0]], dtype=indices.dtype)
    largest = indices.amax(dim=1)
    if bool((largest >= limits).any()):
        raise ValueError(f"{what}: another rank sent indices up to {largest.tolist()} for a "
                         f"tensor of size {tuple(shape)} here; the sparse tensors must have the "
                         f"same size on every rank.")


def check_sparse_op(op: ReduceOp, what: str) -> None:
    """Raise the documented ValueError unless ``op`` can reduce sparse tensors."""
    if op not in _SUPPORTED_OPS:
        raise ValueError(f"{what}: op={op.name} is not supported for sparse tensors; only "
                         f"Average and Sum are. Convert the tensor with .to_dense() (or pass "
                         f"sparse_as_dense=True to DistributedOptimizer) to reduce it with "
                         f"{op.name}.")


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None,
                           op: ReduceOp | int = ReduceOp.Average, process_set=None, *,
                           prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> "SparseAllreduceHandle":
    """Start reducing the sparse COO ``tensor`` across ranks; return a handle.

    Horovod's ``sparse_allreduce_async``: calling the handle (``handle()``, as in Horovod), or
    waiting on it (:func:`hvdlite.torch.synchronize`, ``handle.wait()``) gives a new, coalesced
    sparse tensor of ``tensor``'s size
    and dtype whose entries are the sum (``op=Sum``) or the average (``op=Average``, the sum
    times ``1/size()``) of every rank's entries; it is identical on every rank.  Ranks may have
    different numbers of non-zeros (also none).  Any other op raises ``ValueError`` before
    anything is sent.

    ``name`` must be the same on every rank; the two underlying allgathers are named
    ``f"{name}.indices"`` and ``f"{name}.values"`` (unnamed calls must be issued in the same
    order on every rank).  ``prescale_factor`` multiplies this rank's values before they are
    sent, ``postscale_factor`` the summed values (hvdlite extension, as for dense allreduce;
    DistributedOptimizer uses them for ``gradient_predivide_factor``).  ``process_set`` is
    passed to the allgathers.  Not differentiable.
    """
    what = f"sparse allreduce of {name or 'unnamed tensor'}"
    op = resolve_op(op)
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        kind = (f"a {tensor.layout} tensor" if isinstance(tensor, torch.Tensor)
                else type(tensor).__name__)
        raise TypeError(f"{what}: expected a torch sparse COO tensor, got {kind}; use "
                        f"allreduce for dense tensors.")
    # Check everything before the first allgather is submitted, so that an error leaves
    # nothing half-done (one of the two allgathers in flight).
    check_sparse_op(op, what)
    if op == ReduceOp.Average and tensor.dtype == torch.bool:
        raise ValueError(f"{what}: op=Average is not defined for bool tensors; use Sum.")
    ranks = _group_size(process_set)

    # Coalescing first sends each local index once (the backward of an embedding repeats an
    # index for every lookup of the same row).
    local = tensor.detach().coalesce()
    # allgather concatenates along dimension 0, so the (sparse_dim, nnz) indices travel
    # transposed: one row per non-zero, like the values.
    indices = local.indices().t().contiguous()
    check_tensor(local.values(), what)   # device and dtype, before the indices are on their way
    values = _scale(local.values(), prescale_factor)
    indices_handle = allgather_async(indices, name=None if name is None else f"{name}.indices",
                                     process_set=process_set)
    values_handle = allgather_async(values, name=None if name is None else f"{name}.values",
                                    process_set=process_set)
    shape = tensor.shape
    factor = sparse_postscale(op, postscale_factor, ranks)

    def finish(all_values: torch.Tensor) -> torch.Tensor:
        all_indices = synchronize(indices_handle).t()
        _check_bounds(all_indices, shape, what)
        # The concatenation is the same on every rank, and coalesce (sort + sum of duplicates)
        # is deterministic, so the result is bitwise identical everywhere.  Scaling after the
        # sum, like the dense path's postscale.
        summed = torch.sparse_coo_tensor(all_indices, all_values, shape,
                                         check_invariants=False).coalesce()
        if factor == 1.0:
            return summed
        return torch.sparse_coo_tensor(summed.indices(), _scale(summed.values(), factor),
                                       shape, is_coalesced=True, check_invariants=False)

    # One handle for both: wait() also waits for the indices.  poll() reports the values'
    # allgather; the indices were submitted first, so they are negotiated no later than it.
    return SparseAllreduceHandle(values_handle.then(finish))


class SparseAllreduceHandle(Handle):
    """The handle of :func:`sparse_allreduce_async`.  Calling it waits and returns the reduced
    sparse tensor, as Horovod's (a function) does; it is also an ordinary handle, so
    ``hvd.synchronize(handle)``, ``hvd.poll(handle)`` and ``handle.wait()`` work too."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Handle) -> None:   # (no lock of its own: everything delegates)
        self._inner = inner
        self.name = inner.name

    def __call__(self) -> torch.Tensor:
        return self._inner.wait()

    def then(self, fn) -> "SparseAllreduceHandle":
        self._inner.then(fn)
        return self

    def poll(self) -> bool:
        return self._inner.poll()

    def wait(self, timeout: float | None = None):
        return self._inner.wait(timeout)

    synchronize = wait

    def __repr__(self) -> str:
        return f"<hvdlite.SparseAllreduceHandle {self.name!r} " \
               f"{'done' if self.poll() else 'pending'}>"


def sparse_allreduce(tensor: torch.Tensor, name: str | None = None,
                     op: ReduceOp | int = ReduceOp.Average, process_set=None, *,
                     prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> torch.Tensor:
    """Blocking :func:`sparse_allreduce_async`: the coalesced sparse sum (``op=Sum``) or
    average (``op=Average``, default) of ``tensor`` over all ranks."""
    return synchronize(sparse_allreduce_async(tensor, name, op, process_set,
                                              prescale_factor=prescale_factor,
                                              postscale_factor=postscale_factor))


__all__ = ["sparse_allreduce", "sparse_allreduce_async", "SparseAllreduceHandle"]
