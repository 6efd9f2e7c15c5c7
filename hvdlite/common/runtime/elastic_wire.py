"""What an elastic job's workers and its driver (``hvdlite run --min-np ...``) say to each other,
and how a committed state travels between them.

Both ends use :mod:`multiprocessing.connection` (length-prefixed messages over TCP,
authenticated with the job's random key).  Control messages are small pickled tuples; a
committed state is one tuple naming its frames' sizes followed by the frames themselves, so
that large arrays go from the training process's memory to the socket without a copy and the
driver (which never unpickles a commit: it has no torch or TensorFlow) stores them as they came.

A commit is *packed* on the training thread, at ``commit()``: its small Python objects are
pickled there and then (so later in-place changes cannot leak into it), while the large arrays,
marked :class:`Owned` by the framework state (private copies that nobody changes afterwards),
become out-of-band *leaves* that are turned into bytes only when they are sent, on the
shipping thread.  A *codec* per array type (numpy here; ``hvdlite.torch`` registers torch's)
describes a leaf, exports its bytes and rebuilds it.
"""
from __future__ import annotations

import enum
import pickle
import threading
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

# The environment of every worker the elastic driver starts.
DRIVER_VARIABLE = "HVDLITE_ELASTIC_DRIVER"   # "host:port" of the driver's listener
KEY_VARIABLE = "HVDLITE_ELASTIC_KEY"         # its authentication key, hex
WORLD_VARIABLE = "HVDLITE_ELASTIC_WORLD"     # 0 for the first world, +1 at every reset
# The pid of the process that the MPI launcher started for this worker (the driver's shield,
# hvdlite.runner.elastic.shield); this worker is its child, in a session of its own.
SHIELD_VARIABLE = "HVDLITE_ELASTIC_SHIELD"

# A worker that ends its world so that the driver starts the next one exits with this status
# (EX_TEMPFAIL: "try again"); its report on the connection says why.
EXIT_RESET = 75

CommitId = tuple   # (world, number of the commit in that world): later worlds' commits are newer


class HostUpdateResult(enum.IntFlag):
    """What changed in the job's hosts (Horovod's values)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class Owned:
    """Marks an array that a commit owns (a private copy that nobody changes after the commit):
    it is sent out of band, its bytes exported only when it is shipped."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce_ex__(self, protocol):
        # Only this object costs a Python call while pickling (a persistent_id hook would be
        # called for every object of the state): it files its array as the next leaf.
        leaves = _packing.leaves
        if leaves is None:
            raise pickle.PicklingError("Owned values are pickled by elastic_wire.pack only")
        codec = _codec_for(self.value)
        leaves.append((codec, self.value))
        return _leaf, (len(leaves) - 1, codec.kind, codec.describe(self.value))


class _Context(threading.local):
    leaves: list | None = None          # pack(): the leaves found so far
    buffers: Sequence | None = None     # unpack(): the frames after the header


_packing = _Context()


def _leaf(index: int, kind: str, meta: Any) -> Any:
    """Unpickling an :class:`Owned` array: rebuilt from its frame."""
    buffers = _packing.buffers
    if buffers is None or kind not in _codecs:
        raise pickle.UnpicklingError(f"elastic state: cannot rebuild an out-of-band {kind!r} "
                                     f"value here (import the framework's hvdlite adapter)")
    return _codecs[kind].rebuild(meta, buffers[index])


class Codec(NamedTuple):
    """How one array type travels: ``describe(value)`` -> picklable metadata, ``export(value)``
    -> its raw bytes as a 1-D memoryview of host memory (may copy, e.g. from a GPU), and
    ``rebuild(metadata, buffer)`` -> the array again (it may keep ``buffer``, a bytearray)."""

    kind: str
    type: type
    describe: Callable[[Any], Any]
    export: Callable[[Any], memoryview]
    rebuild: Callable[[Any, bytearray], Any]


def _numpy_export(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _numpy_rebuild(meta, buffer: bytearray) -> np.ndarray:
    dtype, shape = meta
    return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)


_codecs: dict[str, Codec] = {}


def register_codec(codec: Codec) -> None:
    """Let arrays of ``codec.type`` travel out of band (later registrations win for a type)."""
    _codecs[codec.kind] = codec


register_codec(Codec("numpy", np.ndarray, lambda a: (a.dtype.str, a.shape), _numpy_export,
                     _numpy_rebuild))


def _codec_for(value: Any) -> Codec:
    for codec in reversed(list(_codecs.values())):
        if isinstance(value, codec.type):
            return codec
    raise TypeError(f"no way to send a {type(value).__name__} out of band (known: "
                    f"{', '.join(c.type.__name__ for c in _codecs.values())})")


class Packed(NamedTuple):
    """A committed state ready to ship: the pickled objects and the out-of-band arrays."""

    header: bytes
    leaves: list   # [(Codec, value)]

    def frames(self) -> list[memoryview]:
        """Everything to send, in order (exports the leaves: call on the shipping thread)."""
        return [memoryview(self.header)] + [codec.export(value) for codec, value in self.leaves]


def pack(tree: Any) -> Packed:
    """Pickle ``tree`` now, its :class:`Owned` arrays out of band (see the module docstring).
    Objects that plain pickle refuses (lambdas, local classes) go through cloudpickle when it
    is installed, as ``broadcast_object`` does; otherwise the error names what failed."""
    _packing.leaves = leaves = []
    try:
        try:
            header = pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            try:
                import cloudpickle
            except ImportError:
                raise TypeError(f"elastic state: the committed state cannot be pickled "
                                f"({exc}); keep picklable values in the state, or install "
                                f"cloudpickle") from exc
            leaves.clear()
            header = cloudpickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        _packing.leaves = None
    return Packed(header, leaves)


def unpack(frames: Sequence[bytearray]) -> Any:
    """The tree that :func:`pack` packed, from its frames (header first)."""
    _packing.buffers = frames[1:]
    try:
        return pickle.loads(frames[0])
    finally:
        _packing.buffers = None


# --- framing ---------------------------------------------------------------------------------
def send_frames(conn, head: tuple, frames: Sequence[memoryview]) -> None:
    """``head + (sizes,)`` then each frame (the caller holds the connection's send lock)."""
    conn.send((*head, [frame.nbytes for frame in frames]))
    for frame in frames:
        conn.send_bytes(frame)


def recv_frames(conn, sizes: Sequence[int]) -> list[bytearray]:
    """The frames announced by ``sizes``, each read straight into its own buffer."""
    frames = []
    for size in sizes:
        buffer = bytearray(size)
        got = conn.recv_bytes_into(buffer)
        if got != size:
            raise EOFError(f"a frame of {got} bytes where {size} were announced")
        frames.append(buffer)
    return frames
