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
import io
import pickle
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

# The environment of every worker the elastic driver starts.
DRIVER_VARIABLE = "HVDLITE_ELASTIC_DRIVER"   # "host:port" of the driver's listener
KEY_VARIABLE = "HVDLITE_ELASTIC_KEY"         # its authentication key, hex
WORLD_VARIABLE = "HVDLITE_ELASTIC_WORLD"     # 0 for the first world, +1 at every reset

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


class _Pickler(pickle.Pickler):
    def __init__(self, file, leaves: list) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._leaves = leaves

    def persistent_id(self, obj):   # noqa: D102 - pickle's hook
        if type(obj) is Owned:
            codec = _codec_for(obj.value)
            self._leaves.append((codec, obj.value))
            return ("hvdlite-leaf", len(self._leaves) - 1, codec.kind, codec.describe(obj.value))
        return None


def pack(tree: Any) -> Packed:
    """Pickle ``tree`` now, its :class:`Owned` arrays out of band (see the module docstring).
    Objects that plain pickle refuses (lambdas, local classes) go through cloudpickle when it
    is installed, as ``broadcast_object`` does; otherwise the error names what failed."""
    leaves: list = []
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, leaves).dump(tree)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(f"elastic state: the committed state cannot be pickled ({exc}); "
                            f"keep picklable values in the state, or install cloudpickle") from exc

        class _CloudPickler(cloudpickle.Pickler):
            persistent_id = _Pickler.persistent_id

            def __init__(self, file, leaves: list) -> None:
                super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
                self._leaves = leaves

        leaves, buffer = [], io.BytesIO()
        _CloudPickler(buffer, leaves).dump(tree)
    return Packed(buffer.getvalue(), leaves)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, buffers: Sequence[bytearray]) -> None:
        super().__init__(file)
        self._buffers = buffers

    def persistent_load(self, pid):   # noqa: D102 - pickle's hook
        tag, index, kind, meta = pid
        if tag != "hvdlite-leaf" or kind not in _codecs:
            raise pickle.UnpicklingError(f"elastic state: unknown out-of-band value {kind!r} "
                                         f"(import the framework's hvdlite adapter first)")
        return _codecs[kind].rebuild(meta, self._buffers[index])


def unpack(frames: Sequence[bytearray]) -> Any:
    """The tree that :func:`pack` packed, from its frames (header first)."""
    return _Unpickler(io.BytesIO(frames[0]), frames[1:]).load()


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
