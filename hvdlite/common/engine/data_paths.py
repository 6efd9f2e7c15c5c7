"""What the engine hands its data paths and what it gets back; choosing the path for a batch.

A data path (see :mod:`hvdlite.common.data_paths`) moves one negotiated batch's bytes: MPI, the
intra-node shared-memory window, direct copies, host staging of GPU tensors, NCCL.  The engine
asks the paths it was given, in order, which one serves a batch (Horovod's ``Enabled()``), and
runs it there.  The engine knows only this interface; the paths are built by the factory the
engine is created with, so adding a path never touches the engine.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

from hvdlite.common.config import Config
from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import Response

Batch = list[tuple[Response, Entry]]


@dataclasses.dataclass(frozen=True)
class PathContext:
    """What every data path of one process set's engine shares."""

    comm: Any                         # the set's communicator
    global_ranks: list[int]           # the set's members by global rank (messages name those)
    config: Config
    rank: int                         # this process's global rank
    max_sleep: float                  # longest back-off sleep while waiting on peers
    on_slow: Callable[[float], None]  # called about every second of a wait on peers (may raise)
    # Before a GPU batch's collective: every rank says whether it prepared its part; raises on
    # every rank if one failed, so no rank is left alone inside the collective.
    agree: Callable[[BaseException | None], None]


class DeviceWork(NamedTuple):
    """A GPU batch queued on the device: ``event`` fires when it is done, ``keep`` holds the
    memory it uses until then, on GPU ``device``."""

    event: Any
    keep: list
    device: int


def select(paths: list, batch: Batch):
    """The first of ``paths`` whose ``enabled(batch)`` is true."""
    for path in paths:
        if path.enabled(batch):
            return path
    response = batch[0][0]
    raise RuntimeError(f"internal error: no data path serves {response.kind} of "
                       f"{response.name!r} (device {response.device})")
