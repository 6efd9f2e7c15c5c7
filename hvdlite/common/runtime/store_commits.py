"""``hvd.elastic`` commits kept in torchrun's store, so that they outlive torchrun's restarts.

Under ``hvdlite run``'s elastic driver a world's commits live in the driver
(:mod:`~hvdlite.common.runtime.elastic_channel`).  Under torchrun there is no such driver, but
there is a process that outlives the workers: torchrun's agent, whose key-value store
(``TORCHELASTIC_USE_AGENT_STORE``) the world was formed through
(:mod:`~hvdlite.common.runtime.env_world`).  :class:`StoreChannel` answers the same requests
as the driver's channel from that store, so ``hvd.elastic.run`` works unchanged: rank 0 ships
each commit there (paced, newest only), a rank whose world fails offers its newer commit, and
when torchrun starts the workers again (``--max-restarts``, or a membership change under
``--nnodes MIN:MAX``) the new rank 0 fetches the newest commit and every rank runs the reset
callbacks.  Hosts-updated notices have no source here (torchrun restarts the workers itself).

Keys: ``hvdlite/elastic/<run id>/<state key>/latest`` (the newest commit's id) and
``.../<world>.<n>`` (its frames, length-prefixed).  The world number grows with every world:
``restart count * 1_000_000 + formation``, formation counting the worlds formed since the
restart count last changed.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Callable, Optional

from hvdlite.common.runtime import elastic_wire as wire

WORLD_STRIDE = 1_000_000   # formations per restart count, at most
_LENGTH = struct.Struct("!Q")


def world_number(restart_count: int, formation: int) -> int:
    """The elastic world number of formation ``formation`` (0-based) after ``restart_count``
    restarts (monotonic over a torchrun job).  Pure logic."""
    return restart_count * WORLD_STRIDE + formation


def join_frames(frames) -> bytes:
    """Frames as one value (each prefixed with its length).  Pure logic."""
    out = bytearray()
    for frame in frames:
        data = memoryview(frame).cast("B")
        out += _LENGTH.pack(data.nbytes)
        out += data
    return bytes(out)


def split_frames(blob: bytes) -> list[bytearray]:
    """:func:`join_frames`' frames again.  Pure logic."""
    frames, at = [], 0
    while at < len(blob):
        (size,), at = _LENGTH.unpack_from(blob, at), at + _LENGTH.size
        frames.append(bytearray(blob[at:at + size]))
        at += size
    return frames


class StoreChannel:
    """The elastic channel of one rank of world ``world``, over ``store`` (a torch
    ``Store``, keys under ``prefix``)."""

    def __init__(self, store, prefix: str, world: int, rank: int) -> None:
        self._store = store
        self._prefix = prefix
        self.world = world
        self.rank = rank
        self.closed = False
        self.orphaned = False

    def _key(self, key: Any, what: str) -> str:
        return f"{self._prefix}/{key}/{what}"

    def stored(self, key: Any) -> Optional[wire.CommitId]:
        latest = self._key(key, "latest")
        if not self._store.check([latest]):
            return None
        world, n = json.loads(self._store.get(latest))
        return (world, n)

    def send_commit(self, key: Any, commit_id: wire.CommitId, packed: wire.Packed) -> None:
        """Store the commit, then make it the newest unless a newer one is there already
        (compare-and-set: a failing rank's offer and rank 0's shipping may race)."""
        world, n = commit_id
        self._store.set(self._key(key, f"{world}.{n}"), join_frames(packed.frames()))
        latest, new = self._key(key, "latest"), json.dumps([world, n])
        while True:
            have = self.stored(key)
            if have is not None and have >= tuple(commit_id):
                return
            expected = "" if have is None else json.dumps(list(have))
            got = self._store.compare_set(latest, expected, new)
            if got.decode() == new:
                return

    def request(self, message: tuple, timeout: float = 0.0) -> tuple:
        """The driver's answers: ``fetch`` (the newest commit), ``have`` (send yours if it is
        newer), anything else acknowledged."""
        if message[0] == "fetch":
            key = message[1]
            have = self.stored(key)
            if have is None:
                return ("none",)
            blob = self._store.get(self._key(key, f"{have[0]}.{have[1]}"))
            return ("commit", key, have, split_frames(blob))
        if message[0] == "have":
            have = self.stored(message[1])
            return ("send",) if have is None or have < tuple(message[2]) else ("ok",)
        return ("ok",)

    def tell(self, message: tuple) -> None:
        """Nothing listens for notices here."""

    def wait_stored(self, key: Any, commit_id: wire.CommitId, timeout: float) -> bool:
        have = self.stored(key)
        return have is not None and have >= tuple(commit_id)

    def add_listener(self, listener: Callable[[int, int], None]) -> None:
        """No host updates come from torchrun (it restarts the workers itself)."""

    def forget_in_child(self) -> None:
        self.closed = True
