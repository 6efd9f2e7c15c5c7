"""hvdlite's failures as the ``tf.errors`` classes that Horovod's TensorFlow ops raise.

Horovod's TF kernels report every failure as a TensorFlow error: a cross-rank mismatch (shape,
dtype, reduce op, root rank, ...) or an op before ``hvd.init()`` as ``FailedPreconditionError``,
a bad argument (unknown process set, a rank outside it, an invalid ``root_rank``, alltoall
splits, a scalar where rows are needed, a name already in flight) as ``InvalidArgumentError``,
a reducescatter op other than Sum/Average as ``AbortedError``, a job that shut down or stalled
for good as ``UnknownError``.  The TensorFlow adapter raises the same classes.

Each class raised here also derives from the exception it replaces (hvdlite's own class, or
``ValueError`` for an argument error), so both ``except tf.errors.FailedPreconditionError`` (a
Horovod script) and ``except hvd.TensorMismatchError`` / ``except hvd.HorovodInternalError`` /
``except ValueError`` catch it.  Its message is hvdlite's.

Inside a traced graph (``tf.function``, a TF1 session) a collective fails in the Python node
that runs it, and TensorFlow reports whatever that node raises by Python type only:
InvalidArgumentError for a ValueError or TypeError, UnimplementedError for NotImplementedError,
UnknownError for anything else.  There a cross-rank mismatch therefore surfaces as
``InvalidArgumentError`` (Horovod: FailedPreconditionError), with hvdlite's message; argument
errors are raised while the graph is built, with the classes above.
"""
from __future__ import annotations

import functools
import inspect

import tensorflow as tf

from hvdlite.common import core
from hvdlite.common.core import (DuplicateNameError, HvdliteError, NotInitializedError,
                                 TensorMismatchError, UnsupportedDtypeError)

_classes: dict[tuple[type, type], type] = {}


def _both(tf_class: type, py_class: type) -> type:
    """A class deriving from ``tf_class`` and ``py_class``, named like ``tf_class``."""
    key = (tf_class, py_class)
    cls = _classes.get(key)
    if cls is None:
        cls = _classes[key] = type(tf_class.__name__, (tf_class, py_class), {
            "__module__": __name__,
            "__doc__": f"{tf_class.__doc__}\n\nAlso a {py_class.__name__} (hvdlite)."})
    return cls


def aborted(message: str) -> Exception:
    """Horovod's class for an operation its backend refuses (``tf.errors.AbortedError``), also
    an ``HvdliteError``."""
    return _both(tf.errors.AbortedError, HvdliteError)(None, None, message)


def to_tf_error(exc: BaseException) -> BaseException:
    """The exception to raise in place of ``exc`` (raised by hvdlite's core or this adapter):
    ``exc`` itself where Horovod raises the same kind (a TF error already, an unsupported
    dtype, NotImplementedError, other TypeErrors), else an instance of Horovod's TF class that
    is also ``type(exc)``."""
    if isinstance(exc, (tf.errors.OpError, UnsupportedDtypeError, NotImplementedError)):
        # UnsupportedDtypeError is a TypeError, as Horovod's op type check raises; Horovod
        # raises NotImplementedError for what hvdlite raises it for (sparse ops, Adasum size)
        return exc
    if isinstance(exc, (NotInitializedError, TensorMismatchError)):
        tf_class = tf.errors.FailedPreconditionError
    elif isinstance(exc, DuplicateNameError) or type(exc) is ValueError:
        tf_class = tf.errors.InvalidArgumentError
    elif isinstance(exc, HvdliteError):
        tf_class = tf.errors.UnknownError
    else:
        return exc
    converted = _both(tf_class, type(exc))(None, None, str(exc))
    converted.__traceback__ = exc.__traceback__
    if getattr(exc, "_hvdlite_announced", False):   # (raised after submission, or announced)
        converted._hvdlite_announced = True
    return converted


def public_op(fn=None, *, kind: str | None = None, items: str | None = None):
    """Decorator for the public ops: never converted by AutoGraph (they are plain Python that
    builds graph nodes); errors reach the caller as Horovod's TensorFlow error classes (see
    :func:`to_tf_error`), raised directly (AutoGraph would otherwise re-wrap some of them as
    StagingError).  ``kind`` (``items``: the argument holding a group's tensors): an eager op
    of that kind whose own checks fail before it is submitted is announced to the other ranks
    (see ``hvdlite.common.api.announce.announce_failure``), so an unnamed op's failure on one rank
    fails it everywhere instead of shifting the automatic names.  (Inside a graph the names
    are fixed when it is traced, alike on every rank.)"""
    if fn is None:
        return lambda f: public_op(f, kind=kind, items=items)
    signature = inspect.signature(fn) if kind is not None else None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised as Horovod's class
            if signature is not None and tf.executing_eagerly():
                _announce(kind, items, signature, args, kwargs, exc)
            converted = to_tf_error(exc)
            try:
                converted.ag_pass_through = True
            except AttributeError:
                pass
            if converted is exc:
                raise
            raise converted from None

    return tf.autograph.experimental.do_not_convert(wrapper)


def _announce(kind: str, items: str | None, signature, args, kwargs, exc: Exception) -> None:
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:   # a malformed call fails alike on every rank
        return
    name, process_set = bound.get("name"), bound.get("process_set")
    if items is None:
        core.announce_failure(kind, name, process_set, exc)
        return
    try:
        count = len(bound[items])
    except Exception:   # noqa: BLE001 - not a sized group: nothing to pair
        return
    core.announce_group_failure(kind, name, process_set, count, exc)
