"""The ranks a TensorFlow op runs on: its process set's members (checked when the op is
created), the set's id, its size and this rank's place in it.  ``process_set=None`` means the
global set, as everywhere in the adapter."""
from __future__ import annotations

from hvdlite.common import core
from hvdlite.common.core import ProcessSet


def _is_global(process_set) -> bool:
    return process_set is None or (isinstance(process_set, ProcessSet)
                                   and process_set.process_set_id == 0)


def _members(process_set, what: str) -> list[int] | None:
    """Global ranks of ``process_set`` (None for the global set).  Raises the core's error
    if the set is not registered or this rank is not a member."""
    return core.process_set_engine(process_set, what)[1]


def _set_id(process_set) -> int:
    return 0 if _is_global(process_set) else int(process_set.process_set_id)


def _set_size(members: list[int] | None) -> int:
    return core.size() if members is None else len(members)


def _set_rank(members: list[int] | None) -> int:
    return core.rank() if members is None else members.index(core.rank())
