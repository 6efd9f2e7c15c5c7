"""Gradient compression for the wire, framework-neutral: Horovod's ``Compressor`` interface,
``NoneCompressor``, and the casting compressors (``fp16``, ``bf16``) that each adapter builds
with its own dtypes and cast."""
from __future__ import annotations

from typing import Any, Callable


class Compressor:
    """Interface: ``compress`` returns (tensor to send, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def casting_compressor(name: str, doc: str, target: Any, is_floating: Callable[[Any], bool],
                       cast: Callable[[Any, Any], Any]) -> type:
    """A :class:`Compressor` class that sends floating-point tensors as ``target`` and casts
    them back to their own dtype after the reduction; other tensors pass unchanged.
    ``is_floating(dtype)`` and ``cast(tensor, dtype)`` are the framework's."""
    def compress(tensor):
        dtype = tensor.dtype
        if is_floating(dtype) and dtype != target:
            return cast(tensor, target), dtype
        return tensor, None

    def decompress(tensor, ctx):
        return tensor if ctx is None else cast(tensor, ctx)

    return type(name, (Compressor,), {"__doc__": doc, "compress": staticmethod(compress),
                                      "decompress": staticmethod(decompress)})


FP16_DOC = "Send floating-point tensors as float16 (halves the bytes)."
BF16_DOC = "Send floating-point tensors as bfloat16 (halves the bytes, keeps float32's range)."
