"""Gradient buckets: many small gradients reduced as one flat tensor.

Handing a gradient to the engine costs the same few tens of microseconds of Python whatever its
size (a handle, a queue entry, negotiation, a slot in a fused batch, the wait and the copy back),
so a model of many small tensors spends most of its step there.  Like torch's DDP,
DistributedOptimizer therefore packs small gradients into buckets of up to
``HVDLITE_GRADIENT_BUCKET_MB``: the last gradient of a bucket to be accumulated copies all of
them into one flat tensor (``torch._foreach_copy_``: one call) and starts one in-place allreduce
of it; the reduced values are copied back into each ``.grad`` the same way.  Larger gradients
(see :func:`alone_from`) go on their own, reduced in place without a copy.

The plan (which gradients share a bucket, in which order) depends only on what every rank
agrees on: the parameters' order, shapes and dtypes, and the layout (dense) agreed the first
time each gradient was reduced, so every rank builds the same buckets under the same names
(one tiny allreduce checks that, see :func:`plan_buckets`).
"""
from __future__ import annotations

import zlib
from typing import Hashable, Sequence

import torch

from hvdlite.common.core import (FUSE_BELOW_BYTES, ReduceOp, prepare_allreduce,
                                 process_set_engine)

from .compression import BF16Compressor, FP16Compressor, NoneCompressor
from .async_ops import allreduce_async_
from .mpi_ops import allreduce
from .tensor_bridge import as_core_array, check_tensor, order_after_producer

# Compressions a bucket can apply on its own (a cast of floating-point gradients to this wire
# dtype, None: none); any other compressor sees each gradient by itself.
_WIRE_DTYPES = {NoneCompressor: None, FP16Compressor: torch.float16,
                BF16Compressor: torch.bfloat16}


def bucketable_compression(compression) -> bool:
    return compression in _WIRE_DTYPES


def wire_dtype(compression, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``compression`` sends a gradient of ``dtype`` as (one of _WIRE_DTYPES)."""
    target = _WIRE_DTYPES[compression]
    return target if target is not None and dtype.is_floating_point else dtype


def alone_from(device: torch.device, cap_bytes: int) -> int:
    """Gradients of this many bytes or more are reduced on their own.  In host memory the
    engine reduces a tensor of FUSE_BELOW_BYTES or more in place, and fuses smaller ones
    through a buffer (two copies): so small gradients cost no more copies in a bucket that
    large (packing and unpacking replace the fusion's copies), while copying a large gradient
    into a bucket would only add two.  On a GPU copies are cheap next to a hand-off's host
    time, so every gradient under the cap joins a bucket."""
    return cap_bytes if device.type == "cuda" else min(cap_bytes, FUSE_BELOW_BYTES)


def plan(items: Sequence[tuple[Hashable, int]], cap_bytes: int) -> list[list[int]]:
    """Group items (``(key, nbytes)`` each, in the order their gradients are expected) into
    buckets of one key and at most ``cap_bytes`` each, filled greedily in order.  Items of
    ``cap_bytes`` or more, and buckets that would hold a single item, are left out: those
    gradients are reduced on their own.  Returns the buckets' item indices, ordered by their
    first item."""
    buckets: list[list[int]] = []
    open_bucket: dict[Hashable, tuple[list[int], int]] = {}
    for index, (key, nbytes) in enumerate(items):
        if nbytes >= cap_bytes:
            continue
        members, filled = open_bucket.get(key, ([], 0))
        if members and filled + nbytes > cap_bytes:
            buckets.append(members)
            members, filled = [], 0
        members.append(index)
        open_bucket[key] = (members, filled + nbytes)
    buckets.extend(members for members, _ in open_bucket.values())
    return sorted((b for b in buckets if len(b) > 1), key=lambda b: b[0])


class GradientBucket:
    """Parameters whose gradients travel together in ``flat`` (one view per parameter)."""

    __slots__ = ("name", "params", "names", "layout", "flat", "views", "ready", "handle",
                 "reshaped", "_prepared", "_prepared_for")

    def __init__(self, name: str, params: list[torch.Tensor], names: list[str],
                 dtype: torch.dtype) -> None:
        self.name = name
        self.params = params
        self.names = names   # the parameters' own names, for errors
        self.layout = self.signature(params)   # as planned (a parameter may change later)
        numels = [p.numel() for p in params]
        self.flat = torch.empty(sum(numels), dtype=dtype, device=params[0].device)
        self.views = [v.view(p.shape) for v, p in zip(self.flat.split(numels), params)]
        self.ready = 0       # members whose gradient is complete for the coming reduction
        self.handle = None   # the flat tensor's reduction while it is in flight
        self.reshaped = None   # this time's gradients, when they no longer fit (see pack)
        # ``flat``'s reduction checked once and resubmitted every step (core.prepare_allreduce),
        # and what it was prepared with (engine, op, factors)
        self._prepared = None
        self._prepared_for = None

    @staticmethod
    def signature(params: list[torch.Tensor]) -> tuple:
        """What a bucket's layout depends on: a new plan reuses a bucket whose ``layout`` is
        its members' signature."""
        return tuple((id(p), p.shape, p.dtype, p.device) for p in params)

    @property
    def busy(self) -> bool:
        """In flight, or holding gradients that wait for the rest of the bucket."""
        return bool(self.ready) or self.handle is not None

    def submit(self, op: ReduceOp, prescale: float, postscale: float, process_set):
        """Pack the members' gradients and start the bucket's in-place reduction; returns its
        handle.  The reduction of ``flat`` is checked and described once and then resubmitted
        as it is (a bucket is submitted every step: the general path's per-call checks and
        views cost ~50 us of host time per bucket on a GPU), ordered after the producer's
        stream on a GPU as every tensor handed to the core is."""
        flat = self.pack()
        if flat is not self.flat:   # reshaped members (rare): the general path
            return allreduce_async_(flat, name=self.name, op=op, prescale_factor=prescale,
                                    postscale_factor=postscale, process_set=process_set)
        engine = process_set_engine(process_set, f"reducing {self.describe()}")[0]
        prepared = self._prepared
        if prepared is None or self._prepared_for != (engine, op, prescale, postscale):
            check_tensor(flat, f"allreduce_ of {self.name}")
            array, dtype = as_core_array(flat)   # (orders the streams, as below)
            prepared = self._prepared = prepare_allreduce(array, self.name, op, prescale,
                                                          postscale, process_set, dtype)
            self._prepared_for = (engine, op, prescale, postscale)
        elif flat.is_cuda:
            order_after_producer(flat)
        return prepared.submit()

    def pack(self) -> torch.Tensor:
        """Copy the members' gradients into one flat tensor and return it.  A member without a
        gradient (unused on this rank) gets zeros, as every gradient reduced on its own would;
        a sparse gradient is made dense (the bucket was planned for dense gradients).

        Normally that tensor is ``flat``.  If a gradient no longer fits its view (its parameter
        changed shape since the plan; copying would broadcast it), it is a new tensor of shape
        ``(1, n)`` (n: the members' elements now), kept in ``reshaped`` until the reduction is
        over: when every rank changed the parameter alike, the ranks reduce it under the
        bucket's name as usual (and the optimizer plans again), and when only some ranks did,
        its two dimensions never match the others' one-dimensional ``flat``, so negotiation
        fails the bucket on every rank with a shape mismatch instead of mixing up elements."""
        grads = [p.grad for p in self.params]
        if any(g is None or g.is_sparse or g.shape != v.shape
               for g, v in zip(grads, self.views)):
            grads = self._dense_grads()
            if any(g.shape != v.shape for g, v in zip(grads, self.views)):
                self.reshaped = torch.cat([g.reshape(-1).to(self.flat.dtype)
                                           for g in grads]).view(1, -1)
                return self.reshaped
        torch._foreach_copy_(self.views, grads)
        return self.flat

    def _dense_grads(self) -> list[torch.Tensor]:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        return [p.grad for p in self.params]

    def unpack(self) -> None:
        """Copy the reduced values back into the members' ``.grad``."""
        grads = [p.grad for p in self.params]
        if self.reshaped is None:
            torch._foreach_copy_(grads, self.views)
            return
        parts = self.reshaped.view(-1).split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [part.view(g.shape) for part, g in zip(parts, grads)])

    def describe(self) -> str:
        shown = ", ".join(repr(n) for n in self.names[:4])
        more = f" and {len(self.names) - 4} more" if len(self.names) > 4 else ""
        return f"gradient bucket {self.name!r} (the gradients of {shown}{more})"

    def describe_reshaped(self) -> str:
        """'; on this rank ...' naming the members whose shape changed since the plan, or ''."""
        changed = [f"{name!r} is {tuple(p.shape)} instead of {tuple(v.shape)}"
                   for name, p, v in zip(self.names, self.params, self.views)
                   if p.shape != v.shape]
        return f"; on this rank {', '.join(changed)}" if changed else ""


def in_bucket(exc: BaseException, bucket: GradientBucket) -> BaseException:
    """``exc``, an error of ``bucket``'s reduction (of the same type where it can be), with the
    bucket's parameters named."""
    text = (f"{bucket.describe()}: {exc} (the buckets are planned from the parameters' order, "
            f"shapes and dtypes: every rank must wrap the same model; a shape mismatch here "
            f"means that a member changed shape on some ranks only"
            f"{bucket.describe_reshaped()})")
    try:
        wrapped = type(exc)(text)
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        exc.add_note(text)
        return exc
    wrapped.__cause__ = exc
    return wrapped


# --- the plan of an optimizer's buckets ------------------------------------------------------
def bucket_cap(op: ReduceOp, compression, process_set) -> int:
    """Largest bucket in bytes (``HVDLITE_GRADIENT_BUCKET_MB``); 0: no buckets (Adasum combines
    each gradient as a whole, and a custom compressor sees each gradient by itself)."""
    if op == ReduceOp.Adasum or not bucketable_compression(compression):
        return 0
    engine = process_set_engine(process_set, "DistributedOptimizer")[0]
    return engine.config.gradient_bucket_bytes


def wire_bytes(p: torch.Tensor, compression) -> int:
    """Bytes of ``p``'s gradient on the wire."""
    return p.numel() * wire_dtype(compression, p.dtype).itemsize


def goes_alone(p: torch.Tensor, cap: int, compression) -> bool:
    """``p``'s gradient is reduced on its own, whatever the other ranks do: no buckets, not a
    floating-point gradient, or too large (see :func:`alone_from`)."""
    return (cap == 0 or not p.dtype.is_floating_point
            or wire_bytes(p, compression) >= alone_from(p.device, cap))


def plan_buckets(candidates: list, cap: int, compression, names: dict, stem: int,
                 kept: list[GradientBucket], process_set) -> list[GradientBucket]:
    """The buckets of ``candidates`` (the parameters that may share one, in the order their
    gradients are expected), the same on every rank.  ``names`` maps every parameter of the
    optimizer to its name on the wire (``stem`` characters of it are the optimizer's prefix);
    buckets of ``kept`` whose members did not change are reused."""
    groups = _group_into_buckets(candidates, cap, compression)
    if cap and names and not _same_plan_everywhere(groups, names, process_set):
        # The parameters were registered in another order on some rank (a model built by
        # iterating over a set, say): names are what the ranks share, so order by them.
        candidates = sorted(candidates, key=names.__getitem__)
        groups = _group_into_buckets(candidates, cap, compression)
    reusable = {b.layout: b for b in kept}
    buckets = []
    for members in groups:
        bucket = reusable.get(GradientBucket.signature(members))
        if bucket is None:
            bucket = GradientBucket(f"{names[members[0]]}+{len(members) - 1}", members,
                                    [names[p][stem:] for p in members],
                                    wire_dtype(compression, members[0].dtype))
        buckets.append(bucket)
    return buckets


def _group_into_buckets(candidates: list, cap: int, compression) -> list[list[torch.Tensor]]:
    items = [((p.device, p.dtype, wire_dtype(compression, p.dtype)), wire_bytes(p, compression))
             for p in candidates]
    return [[candidates[i] for i in indices] for indices in plan(items, cap)]


def _same_plan_everywhere(groups: list, names: dict, process_set) -> bool:
    """One tiny allreduce: did every rank plan the same buckets?  (The maxima of the digest
    d and of 2**32 - d sum to 2**32 exactly when every rank has the same d; a rank that
    has joined contributes zeros, which change neither maximum.)"""
    text = "\n".join(",".join(f"{names[p]}:{tuple(p.shape)}:{p.dtype}" for p in g)
                     for g in groups)
    digest = zlib.crc32(text.encode())
    maxima = allreduce(torch.tensor([digest, 2**32 - digest], dtype=torch.int64),
                       name=f"{min(names.values())}.bucket_plan", op=ReduceOp.Max,
                       process_set=process_set)
    return int(maxima[0]) + int(maxima[1]) == 2**32
