"""Each gradient's layout (dense, or sparse with its number of sparse dimensions), agreed with
the other ranks the first time DistributedOptimizer reduces it, and what a rank without a
gradient sends in its place.

A rank without a gradient (its loss did not reach the parameter this step) cannot tell whether
the others start a dense allreduce or a sparse reduction (an embedding that its first batch did
not use), and guessing wrong leaves every rank waiting for good.  So the first reduction of
each parameter comes with a vote (:mod:`hvdlite.common.api.grad_layouts`): every rank sends
what it has (-1 nothing, 0 dense, k sparse with k sparse dimensions; the maximum wins).  A rank
with a gradient goes on at once with its own; one without waits for the vote in
``synchronize()`` and then joins the agreed reduction with zeros of that layout.  (With
``sparse_as_dense`` every rank sends a dense tensor, but a rank without a gradient still learns
that the result is to be made sparse.)
"""
from __future__ import annotations

from typing import Callable

import torch

from hvdlite.common.core import Handle, vote_layouts_async

NO_GRADIENT = -1   # a rank's vote when it has no gradient; 0 is dense, k > 0 sparse
# Marks a reducer's handle entry (``(vote handle, LAYOUT_PENDING, None)``) of a rank without a
# gradient, waiting to learn which reduction (dense or sparse) the other ranks started for that
# parameter the first time it is reduced (see :meth:`GradLayouts.resolve`).
LAYOUT_PENDING = object()


class GradLayouts:
    """The agreed layout of each parameter's gradient, and this step's votes in flight."""

    __slots__ = ("known", "_votes", "_sparse_as_dense", "_process_set")

    def __init__(self, sparse_as_dense: bool, process_set) -> None:
        self.known: dict = {}   # param -> sparse_dim of its gradient, 0 = dense
        self._votes: list[Handle] = []   # this step's votes of this rank's own gradients
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set

    def vote(self, p: torch.Tensor, name: str) -> Handle | None:
        """Start ``p``'s vote (its first reduction).  With a gradient here, its layout is
        recorded and None returned: the reduction goes on at once (the vote is waited for in
        :meth:`wait_votes`).  Without one, the vote's handle is returned: :meth:`settle` it
        before choosing the reduction."""
        grad = p.grad
        code = NO_GRADIENT if grad is None else (grad.sparse_dim() if grad.is_sparse else 0)
        handle = vote_layouts_async([code], f"{name}.layout", self._process_set)
        if grad is None:
            return handle
        self.known[p] = code
        self._votes.append(handle)
        return None

    def settle(self, p: torch.Tensor, handle: Handle) -> bool:
        """Wait for the vote of ``p`` (no gradient here) and record the agreed layout; False
        when no rank has a gradient (a reduction would give zeros)."""
        code = int(handle.wait()[0])
        if code < 0:   # (NO_GRADIENT everywhere)
            return False
        self.known[p] = code
        return True

    def resolve(self, handles: dict, reduce_grad_async: Callable, names: dict
                ) -> BaseException | None:
        """Settle the votes of the entries of ``handles`` (param -> reducer's entry) marked
        LAYOUT_PENDING and start those reductions (``reduce_grad_async(p, names[p])`` gives the
        new entry; no entry where no rank has a gradient: zeros are the result); wait for the
        other votes.  Returns the first error (raised by the caller after everything in flight
        has been waited for)."""
        first_error = None
        for p, (handle, ctx, _) in list(handles.items()):
            if ctx is not LAYOUT_PENDING:
                continue
            del handles[p]
            try:
                if not self.settle(p, handle):
                    p.grad = torch.zeros_like(p)   # no rank has a gradient: that is the result
                    continue
                handles[p] = reduce_grad_async(p, names[p])
            except Exception as exc:  # noqa: BLE001 - returned
                first_error = first_error or exc
        votes_error = self.wait_votes()
        return first_error or votes_error

    def wait_votes(self) -> BaseException | None:
        """Wait for this step's other votes; return the first error (raised by the caller
        once everything in flight has been waited for)."""
        first_error = None
        handles, self._votes = self._votes, []
        for handle in handles:
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - returned
                first_error = first_error or exc
        return first_error

    def zeros_like(self, p: torch.Tensor) -> torch.Tensor:
        """Zero gradient for a parameter unused on this rank.  A parameter whose gradient is
        sparse (seen here, or agreed with the other ranks) contributes an empty sparse tensor,
        so that it joins the other ranks' sparse reduction instead of starting a dense one they
        never match."""
        sparse_dim = self.known.get(p, 0)
        if sparse_dim == 0 or self._sparse_as_dense:
            return torch.zeros_like(p)
        indices = torch.empty((sparse_dim, 0), dtype=torch.int64)
        values = p.detach().new_empty((0, *p.shape[sparse_dim:]))
        return torch.sparse_coo_tensor(indices, values, p.shape, is_coalesced=True,
                                       check_invariants=False)

    def sparse_again(self, p: torch.Tensor) -> None:
        """sparse_as_dense (the caller checks it), as in Horovod: a sparse gradient, reduced
        densely, is made sparse again (``to_sparse()``: every dimension sparse, exact zeros
        left out) before the update, so optimizers that take only sparse gradients
        (``SparseAdam``) work.  On a rank without a gradient of its own it becomes sparse too
        (Horovod leaves that one dense): the ranks agreed on the layout the first time the
        parameter was reduced."""
        if self.known.get(p, 0) > 0 and not p.grad.is_sparse:
            p.grad = p.grad.to_sparse()
