"""The ranks a TensorFlow op runs on: its process set's members (checked when the op is
created), the set's id, its size and this rank's place in it.  ``process_set=None`` means the
global set, as everywhere in the adapter."""
from __future__ import annotations

from hvdlite.common import core
from hvdlite.common.core import ProcessSet


def _is_global(process_set) -> bool:
    return process_set is None or (isinstance(process_set, ProcessSet)
                                   and process_set.process_set_id == 0)


def members_of(process_set, what: str) -> list[int] | None:
    """Global ranks of ``process_set`` (None for the global set).  Raises the core's error
    if the set is not registered or this rank is not a member."""
    return core.process_set_engine(process_set, what)[1]


def id_of(process_set) -> int:
    """The process set's id (0 for the global set)."""
    return 0 if _is_global(process_set) else int(process_set.process_set_id)


def size_of(members: list[int] | None) -> int:
    """The set's size, from :func:`members_of`'s answer."""
    return core.size() if members is None else len(members)


def rank_in(members: list[int] | None) -> int:
    """This rank's place in the set, from :func:`members_of`'s answer."""
    return core.rank() if members is None else members.index(core.rank())
