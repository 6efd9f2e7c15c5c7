"""``join()`` in the negotiation: what a joined rank contributes, which cached operations it
announces, and agreeing on the last rank to join."""
from __future__ import annotations

from hvdlite.common.dtypes import dtype_info, reduction_identity
from hvdlite.common.engine.handle import Entry, Handle
from hvdlite.common.engine.messages import Request, Response, runs_while_joined
from hvdlite.common.engine.response_cache import ResponseCache
from hvdlite.common.reduce_ops import ReduceOp


def stand_in(response: Response) -> Entry:
    """What a joined rank contributes to a reduction it never submitted: the identity (for
    each member of a grouped allreduce)."""
    if response.members:
        request = Request(response.name, response.kind, response.dtype, response.shape,
                          response.reduce_op, cacheable=response.cacheable)
        entry = Entry(request, None, None, None, Handle(response.name, lambda: True))
        entry.stand_in = True
        entry.members = [stand_in(member) for member in response.members]
        return entry
    info = dtype_info(response.dtype)
    array = reduction_identity(info, ReduceOp(response.reduce_op), response.shape)
    request = Request(response.name, response.kind, response.dtype, response.shape,
                      response.reduce_op, response.root, response.device, response.prescale,
                      response.postscale, cacheable=response.cacheable)
    entry = Entry(request, array, array, None, Handle(response.name, lambda: True))
    entry.stand_in = True
    return entry


def reducible_slots(cache: ResponseCache) -> list[int]:
    """The cached operations a joined rank announces as ready (it stands in for them)."""
    return [slot for slot, response in cache.items()
            if runs_while_joined(response.kind, response.reduce_op)]


def route_unjoinable(pending: dict[str, Entry], cache: ResponseCache) -> None:
    """Some rank has joined: cached operations that cannot run without it go to the
    coordinator, which fails them with a clear error instead of letting them wait."""
    for entry in pending.values():
        if entry.slot is not None:
            response = cache.response(entry.slot)
            if not runs_while_joined(response.kind, response.reduce_op):
                entry.slot = None


def last_to_join(pairs: list[list[int]]) -> int:
    """Every rank's (round it joined in, global rank): the last to join (latest round; ties ->
    highest rank), the same on every rank."""
    return int(max(pairs)[1])
