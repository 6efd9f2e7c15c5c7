"""Negotiation messages and their cross-rank validation (pure logic, no MPI).

A :class:`Request` says "this rank has tensor <name> ready, with these properties".  The
coordinator collects one per rank and turns them into a :class:`Response` (what every rank will
execute) or an error response that names the tensor, what each rank sent and which ranks disagree.
"""
from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
BROADCAST = "broadcast"
BARRIER = "barrier"
ALLTOALL = "alltoall"
REDUCESCATTER = "reducescatter"
JOIN = "join"
# Stands for an operation that raised on this rank before it could be submitted: the other ranks'
# operation under the same name fails with the cause instead of waiting for it, and automatic
# names stay paired across ranks (see ``ops.announce_failure``).
FAILED = "failed"

# Kinds that reduce, i.e. can run while some ranks have joined (they contribute the identity).
REDUCING_KINDS = (ALLREDUCE,)


def runs_while_joined(kind: str, reduce_op: int) -> bool:
    """Whether an operation can run with joined ranks standing in with the op's identity
    (Adasum has no neutral contribution)."""
    from hvdlite.common.reduce_ops import ReduceOp
    return kind in REDUCING_KINDS and reduce_op != ReduceOp.Adasum

ERROR_MISMATCH = "mismatch"
ERROR_STALL = "stall"
ERROR_FAILED_ON_RANK = "failed on a rank"


class Request(NamedTuple):
    name: str
    kind: str
    dtype: str
    shape: tuple
    reduce_op: int = -1
    root: int = -1
    device: int = -1          # -1 = host memory, else the CUDA device ordinal
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple = ()        # alltoall: rows this rank sends to each rank
    # A grouped operation (allreduce, allgather, reducescatter), negotiated as one request
    # named after the group: its members' (name, dtype, shape, device), in order.  Empty for
    # every other request.
    layout: tuple = ()
    cacheable: bool = True    # auto-named tensors never repeat, so caching them is waste
    failure: str = ""         # FAILED: the error this rank raised (type and message)

    def signature(self) -> tuple:
        """Everything that must match for a cached response to be reused."""
        return self[SIGNATURE]


# The fields from ``kind`` to ``layout``: a request's signature.  A slice, so that the
# controller's per-tensor cache test can take it without a method call.
SIGNATURE = slice(Request._fields.index("kind"), Request._fields.index("layout") + 1)


class Response(NamedTuple):
    name: str
    kind: str
    dtype: str = ""
    shape: tuple = ()
    reduce_op: int = -1
    root: int = -1
    device: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    first_dims: tuple = ()      # allgather: first dimension contributed by each rank
    error: str | None = None
    error_kind: str | None = None
    cacheable: bool = True
    splits: tuple = ()          # alltoall: every rank's splits, in rank order
    # A grouped operation negotiated as one request: one response per member, in order (what
    # the data paths execute; see Request.layout).  Empty for every other response.
    members: tuple = ()


def _describe_values(name: str, kind: str, field: str, by_rank: Mapping[int, object]) -> str:
    groups: dict[object, list[int]] = {}
    for rank in sorted(by_rank):
        groups.setdefault(by_rank[rank], []).append(rank)
    reference = by_rank[min(by_rank)]
    disagree = sorted(r for r, v in by_rank.items() if v != reference)
    parts = "; ".join(f"{field} {value!r} on ranks {ranks}" for value, ranks in groups.items())
    return (f"Mismatched {field} for tensor {name!r} in {kind}: {parts}. "
            f"Ranks {disagree} disagree with rank {min(by_rank)}. Every rank must submit "
            f"{name!r} with the same {field}; check that each rank runs the same model and "
            f"passes the same arguments.")


def _first_mismatch(name: str, kind: str, requests: Mapping[int, Request],
                    fields: Iterable[tuple[str, callable]]) -> str | None:
    for field, get in fields:
        by_rank = {rank: get(req) for rank, req in requests.items()}
        if len(set(by_rank.values())) > 1:
            return _describe_values(name, kind, field, by_rank)
    return None


def build_response(requests: Mapping[int, Request], joined: Iterable[int] = ()) -> Response:
    """Validate one request per rank for the same tensor name; return what to execute.

    ``requests`` maps rank -> request.  ``joined`` lists ranks that called ``join()`` and did not
    submit this tensor: they take part in reductions with the reduction's identity; any other
    operation cannot run without them and fails with an error saying so.
    """
    name = next(iter(requests.values())).name
    failed = sorted(rank for rank, req in requests.items() if req.kind == FAILED)
    if failed:
        return Response(name, "error", error=_failed_on_ranks(name, requests, failed),
                        error_kind=ERROR_FAILED_ON_RANK, cacheable=False)
    by_kind = {rank: req.kind for rank, req in requests.items()}
    if len(set(by_kind.values())) > 1:
        return Response(name, "error", error=_describe_values(name, "negotiation", "operation",
                                                              by_kind),
                        error_kind=ERROR_MISMATCH)
    first = requests[min(requests)]
    kind = first.kind
    fields = [("operation", lambda r: r.kind), ("dtype", lambda r: r.dtype),
              # CPU against GPU matters; which GPU a rank uses does not (one GPU per rank)
              ("device", lambda r: "cpu" if r.device < 0 else "gpu")]
    if kind in (ALLREDUCE, REDUCESCATTER):
        fields += [("reduce op", lambda r: r.reduce_op), ("shape", lambda r: r.shape),
                   ("prescale factor", lambda r: r.prescale),
                   ("postscale factor", lambda r: r.postscale)]
    elif kind == BROADCAST:
        fields += [("root rank", lambda r: r.root), ("shape", lambda r: r.shape)]
    elif kind in (ALLGATHER, ALLTOALL):
        fields += [("number of dimensions", lambda r: len(r.shape)),
                   ("shape after the first dimension", lambda r: tuple(r.shape[1:]))]
    error = _first_mismatch(name, kind, requests, fields)
    if error is None and first.layout:
        error = _layout_mismatch(name, kind, requests)
    if error is not None:
        if "reduce op" in error:
            from hvdlite.common.reduce_ops import ReduceOp
            for op in ReduceOp:
                error = error.replace(f"reduce op {int(op)!r}", f"reduce op {op.name}")
        return Response(name, kind, error=error, error_kind=ERROR_MISMATCH)
    joined = sorted(set(joined) - set(requests))
    if joined:
        error = _joined_error(first, sorted(requests), joined)
        if error is not None:
            return Response(name, kind, error=error, error_kind=ERROR_MISMATCH)
    ranks = sorted(requests)
    first_dims = ()
    if kind in (ALLGATHER, ALLTOALL) and not first.layout:
        first_dims = _first_dims([requests[r].shape for r in ranks])
    splits = tuple(requests[r].splits for r in ranks) if kind == ALLTOALL else ()
    cacheable = all(r.cacheable for r in requests.values())
    members = tuple(
        Response(member, kind, dtype, shape, first.reduce_op, first.root, device,
                 first.prescale, first.postscale,
                 _first_dims([requests[r].layout[i][2] for r in ranks])
                 if kind == ALLGATHER else (), cacheable=cacheable)
        for i, (member, dtype, shape, device) in enumerate(first.layout))
    return Response(name, kind, first.dtype, first.shape, first.reduce_op, first.root,
                    first.device, first.prescale, first.postscale, first_dims,
                    cacheable=cacheable, splits=splits, members=members)


def _first_dims(shapes: list[tuple]) -> tuple:
    """Allgather: the rows each rank contributes (a 0-d tensor counts as one row)."""
    return tuple(shape[0] if shape else 1 for shape in shapes)


def _layout_mismatch(name: str, kind: str, requests: Mapping[int, Request]) -> str | None:
    """Where the members of a grouped operation (one request per rank, see Request.layout)
    differ between ranks, naming the first member that does; None if they agree.  An
    allgather's members may differ in their first dimension, as single allgathers may."""
    layouts = {rank: req.layout for rank, req in requests.items()}
    if len(set(layouts.values())) == 1:
        return None
    what = f"grouped {kind} {name!r}"
    counts = {rank: len(layout) for rank, layout in layouts.items()}
    if len(set(counts.values())) > 1:
        return _describe_values(name, what, "number of tensors", counts)
    for i in range(len(layouts[min(layouts)])):
        fields = [("name", lambda layout: layout[i][0]), ("dtype", lambda layout: layout[i][1]),
                  ("device", lambda layout: "cpu" if layout[i][3] < 0 else "gpu")]
        if kind == ALLGATHER:
            fields += [("number of dimensions", lambda layout: len(layout[i][2])),
                       ("shape after the first dimension", lambda layout: layout[i][2][1:])]
        else:
            fields += [("shape", lambda layout: layout[i][2])]
        for field, get in fields:
            by_rank = {rank: get(layout) for rank, layout in layouts.items()}
            if len(set(by_rank.values())) > 1:
                member = layouts[min(layouts)][i][0]
                return (f"{what} failed because of its member {member!r} (tensor {i} of "
                        f"{counts[min(counts)]}): "
                        + _describe_values(member, f"grouped {kind}", field, by_rank))
    return None


def _failed_on_ranks(name: str, requests: Mapping[int, Request], failed: list[int]) -> str:
    kinds = sorted({req.kind for req in requests.values() if req.kind != FAILED})
    what = f"{kinds[0]} {name!r}" if len(kinds) == 1 else repr(name)
    causes = "; ".join(f"rank {rank}: {requests[rank].failure}" for rank in failed)
    return (f"{what} failed on ranks {failed}, which raised before submitting it ({causes}). "
            f"The operation fails on every rank, so no rank waits for it; later operations "
            f"(named or unnamed) stay paired. Fix the input on ranks {failed}.")


def _joined_error(request: Request, submitted: list[int], joined: list[int]) -> str | None:
    if runs_while_joined(request.kind, request.reduce_op):
        return None
    what = f"{request.kind} of {request.name!r}"
    if request.kind not in REDUCING_KINDS:
        return (f"{what} cannot run: ranks {joined} have called join() and no longer take part "
                f"(submitted on ranks {submitted}). Only allreduce works while ranks are joined; "
                f"run {request.kind} before join() on every rank.")
    return (f"{what} with op=Adasum cannot run while ranks {joined} have joined (Adasum has "
            f"no neutral contribution); use Average or Sum, or reduce before join().")


def split_rows(rows: int, parts: int) -> list[int]:
    """Rows per rank when ``rows`` are divided as evenly as possible (reducescatter): the first
    ``rows % parts`` ranks get one extra row."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
