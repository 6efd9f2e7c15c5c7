"""Automatic names for unnamed operations, and failure announcements.

Unnamed operations are paired across ranks by the order of their automatic names, so an
operation that fails its checks on one rank before it is submitted still takes its name there
and submits a FAILED stand-in under it: the other ranks' operation then fails with an error
naming this rank and the cause, instead of waiting for a submission that never comes.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
from typing import Callable, Iterator

from hvdlite.common.engine.handle import Entry
from hvdlite.common.engine.messages import FAILED, Request
from hvdlite.common.errors import (DuplicateNameError, HvdliteError, NotInitializedError,
                                   ShutdownError)
from hvdlite.common.runtime import lifecycle, registry, state
from hvdlite.common.runtime.process_sets import ProcessSet, global_process_set

_counter_lock = threading.Lock()
_counters: dict[tuple[str, int], itertools.count] = {}


def auto_name(kind: str, set_id: int = 0) -> str:
    """The next automatic name of an unnamed ``kind`` operation in process set ``set_id``
    (every rank draws them in the same order, so they pair up across ranks)."""
    # One counter per process set: unnamed ops in a set must not shift the global set's names.
    with _counter_lock:
        counter = _counters.setdefault((kind, set_id), itertools.count())
        n = next(counter)
    return f"{kind}.noname.{n}" if set_id == 0 else f"{kind}.set{set_id}.noname.{n}"


# Errors after which no stand-in can be submitted (nothing runs any more, or the name is busy).
NOTHING_TO_ANNOUNCE = (DuplicateNameError, ShutdownError, NotInitializedError)
# The cause sent to the other ranks with a FAILED stand-in is cut to this many characters.
_FAILURE_TEXT_LIMIT = 600


def reset_auto_names() -> None:
    """Restart the unnamed-op counters (at shutdown: process set ids restart with a new init)."""
    with _counter_lock:
        _counters.clear()


# Every rank re-initializes together after a shutdown, so unnamed operations restart in step.
lifecycle.on_shutdown(reset_auto_names)



def announce_failure(kind: str, name: str | None, process_set: ProcessSet | None,
                     error: BaseException) -> None:
    """Tell the other ranks that this rank's unnamed ``kind`` operation raised ``error`` before
    it could be submitted (adapters call this when their own checks fail; the core's checks do
    it themselves).  The operation takes its automatic name here, so the ranks' later automatic
    names stay paired, and the other ranks' operation under that name fails with an error
    naming this rank and the cause instead of waiting for a submission that never comes.

    Named operations are not announced: the rank may retry under the same name (the others'
    operation then completes with the retry), and a stand-in would occupy the name.  Nothing is
    announced where no operation could be submitted (not initialized, not a member of
    ``process_set``, shut down)."""
    if (name is not None or getattr(error, "_hvdlite_announced", False)
            or isinstance(error, NOTHING_TO_ANNOUNCE)):
        return
    try:
        if process_set is None or process_set is global_process_set:
            engine, members, set_id = state.engine(), None, 0
        else:
            engine, members = registry.process_set_engine(process_set, f"{kind} of a tensor")
            set_id = 0 if members is None else process_set.process_set_id
    except Exception:   # noqa: BLE001 - nothing can be submitted here, so nothing is owed
        return
    announce_name(engine, members, auto_name(kind, set_id), error)


@contextlib.contextmanager
def announced(kind: str, name: str | None, process_set: ProcessSet | None) -> Iterator[None]:
    """Announce an error raised inside the block (an operation's checks before it is
    submitted; see :func:`announce_failure`).  Never around a wait: an operation's own error,
    raised when it is waited for, was submitted, and announcing it would shift the names."""
    try:
        yield
    except Exception as exc:
        announce_failure(kind, name, process_set, exc)
        raise


def announcing_with(announce: Callable[[dict, Exception], None]) -> Callable[[Callable], Callable]:
    """Decorator factory: an error the decorated public operation raises (always before its
    submission was taken) and nothing announced yet is passed to ``announce(arguments, error)``
    with the call's bound arguments, then re-raised.  A malformed call (arguments that do not
    bind) is not announced: it fails alike on every rank."""
    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if not getattr(exc, "_hvdlite_announced", False):
                    try:
                        bound = signature.bind(*args, **kwargs).arguments
                    except TypeError:
                        raise exc from None
                    announce(bound, exc)
                raise
        return call
    return decorate


def announcing(kind: str) -> Callable[[Callable], Callable]:
    """Decorator for a public operation that returns a handle and takes ``name`` and
    ``process_set`` arguments: an error it raises (always before its submission was taken) is
    announced (see :func:`announce_failure`), whichever check raised it."""
    return announcing_with(lambda bound, exc: announce_failure(
        kind, bound.get("name"), bound.get("process_set"), exc))


def announce_name(engine, members: list[int] | None, name: str, error: BaseException) -> None:
    """Submit a FAILED stand-in under ``name`` (a group stands in under its own name, see
    :func:`hvdlite.common.api.grouped.group_request`).  Best effort: the caller re-raises
    ``error``."""
    try:
        error._hvdlite_announced = True   # outer layers (see announcing) must not announce again
    except AttributeError:
        pass
    if isinstance(error, NOTHING_TO_ANNOUNCE):
        return   # the name is busy here, or nothing runs any more: nothing can stand in
    failure = f"{type(error).__name__}: {error}"
    if len(failure) > _FAILURE_TEXT_LIMIT:
        failure = failure[:_FAILURE_TEXT_LIMIT] + "..."
    entry = Entry(Request(name, FAILED, "uint8", (), cacheable=False, failure=failure),
                  None, None, None, engine.new_handle(name))
    try:
        engine.submit(entry)
    except HvdliteError:   # e.g. the name is in flight here already
        pass

