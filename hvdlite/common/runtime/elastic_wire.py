"""What an elastic job's workers and its driver (``hvdlite run --min-np ...``) say to each other,
and how a committed state travels between them.

Both ends use :mod:`multiprocessing.connection` (length-prefixed messages over TCP,
authenticated with the job's random key).  Control messages are small pickled tuples; a
committed state is one tuple naming its frames' sizes followed by the frames themselves, so
that large arrays go from the training process's memory to the socket without a copy and the
driver (which never unpickles a commit: it has no torch or TensorFlow) stores them as they came.

A commit is the tree that the state's ``committed_state()`` returned at ``commit()``: private
copies of its arrays (snapshots that nobody changes afterwards) and its small Python objects
already pickled, so it can be packed later, on another thread, without a race.  Packing pickles
it with every array of a registered type (numpy here; ``hvdlite.torch`` registers torch's) sent
out of band: a *codec* per type describes the array, exports its bytes and rebuilds it.
"""
from __future__ import annotations

import enum
import io
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


class _Context(threading.local):
    leaves: list | None = None          # pack(): the arrays found so far
    buffers: Sequence | None = None     # unpack(): the frames after the header


_packing = _Context()


def _leaf(index: int, kind: str, meta: Any) -> Any:
    """Unpickling an out-of-band array: rebuilt from its frame."""
    buffers = _packing.buffers
    if buffers is None or kind not in _codecs:
        raise pickle.UnpicklingError(f"elastic state: cannot rebuild an out-of-band {kind!r} "
                                     f"value here (import the framework's hvdlite adapter)")
    return _codecs[kind].rebuild(meta, buffers[index])


class Codec(NamedTuple):
    """How one array type travels: ``accepts(value)`` (e.g. dense arrays only),
    ``describe(value)`` -> picklable metadata, ``export(value)`` -> its raw bytes as a 1-D
    memoryview of host memory (may copy, e.g. from a GPU), and ``rebuild(metadata, buffer)`` ->
    the array again (it may keep ``buffer``, a bytearray)."""

    kind: str
    type: type
    accepts: Callable[[Any], bool]
    describe: Callable[[Any], Any]
    export: Callable[[Any], memoryview]
    rebuild: Callable[[Any, bytearray], Any]


def _numpy_export(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _numpy_rebuild(meta, buffer: bytearray) -> np.ndarray:
    dtype, shape = meta
    return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)


_codecs: dict[str, Codec] = {}
_by_type: dict[type, Codec | None] = {}   # exact type -> its codec (None: pickled in band)


def register_codec(codec: Codec) -> None:
    """Let arrays of ``codec.type`` travel out of band (later registrations win for a type)."""
    _codecs[codec.kind] = codec
    _by_type.clear()


register_codec(Codec("numpy", np.ndarray, lambda a: not a.dtype.hasobject,
                     lambda a: (a.dtype.str, a.shape), _numpy_export, _numpy_rebuild))


def _codec_for(value: Any) -> Codec | None:
    kind = type(value)
    if kind not in _by_type:
        _by_type[kind] = next((c for c in reversed(list(_codecs.values()))
                               if issubclass(kind, c.type)), None)
    codec = _by_type[kind]
    return codec if codec is not None and codec.accepts(value) else None


class Packed(NamedTuple):
    """A committed state ready to ship: the pickled objects and the out-of-band arrays."""

    header: bytes
    leaves: list   # [(Codec, value)]

    def frames(self) -> list[memoryview]:
        """Everything to send, in order (exports the leaves: call on the shipping thread)."""
        return [memoryview(self.header)] + [codec.export(value) for codec, value in self.leaves]


def _reduce_array(pickler, obj):
    """``reducer_override``: an array of a registered type becomes the next leaf.  (Pickle
    skips the hook for plain ints, floats, strings, lists, tuples and dicts, so a state costs
    one Python call per array and other object, not per value.)"""
    codec = _codec_for(obj)
    if codec is None:
        return NotImplemented
    leaves = _packing.leaves
    leaves.append((codec, obj))
    return _leaf, (len(leaves) - 1, codec.kind, codec.describe(obj))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):   # noqa: D102 - pickle's hook
        return _reduce_array(self, obj)


def pack(tree: Any) -> Packed:
    """Pickle ``tree`` (a committed state: see the module docstring), its arrays out of band.
    Objects that plain pickle refuses (lambdas, local classes) go through cloudpickle when it
    is installed, as ``broadcast_object`` does; otherwise the error names what failed."""
    _packing.leaves = leaves = []
    try:
        buffer = io.BytesIO()
        try:
            _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(tree)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            try:
                import cloudpickle
            except ImportError:
                raise TypeError(f"elastic state: the committed state cannot be pickled "
                                f"({exc}); keep picklable values in the state, or install "
                                f"cloudpickle") from exc

            class _CloudPickler(cloudpickle.Pickler):
                def reducer_override(self, obj):
                    reduced = _reduce_array(self, obj)
                    return super().reducer_override(obj) if reduced is NotImplemented \
                        else reduced

            leaves.clear()
            buffer = io.BytesIO()
            _CloudPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(tree)
    finally:
        _packing.leaves = None
    return Packed(buffer.getvalue(), leaves)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled now, in band (cloudpickle for what pickle refuses, when installed): how
    a state keeps the small objects of a commit, immune to later changes in place."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(f"elastic state: a value of the state cannot be pickled ({exc}); "
                            f"keep picklable values in the state, or install cloudpickle") \
                from exc
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


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
